"""A private PgBouncer in transaction pooling, in front of a Postgres server.

Used by ``make test-pgbouncer`` (the second CI pass) and ``bench/fleet.py``:

    python -m tests.pgbouncer run [--pool-size N] -- COMMAND ...

starts one (its own config and log in a temporary folder, a free port on
127.0.0.1, ``pool_mode = transaction``), runs COMMAND with ``MOTIR_DATABASE_URL``
pointing at it (same user and database, PgBouncer's port; ``MOTIR_PREPARED_STATEMENTS=0``;
``MOTIR_PGBOUNCER_ADMIN`` = its admin console; ``MOTIR_DIRECT_DATABASE_URL`` = the
URL it routes to), stops it, and exits with COMMAND's status.

The upstream is ``MOTIR_DATABASE_URL``'s host and port (``*`` routes any database
name there, so a test session's freshly created database is reachable at once).
Authentication is ``trust``, which is what the machine's trust Postgres needs: the
URL's user and the engine's roles are in ``auth_file``, and any other login (one a
test creates at runtime) is looked up on the server with ``auth_query`` as the URL's
user (``auth_user``). In production use ``auth_type = scram-sha-256`` instead.

PgBouncer refuses to run as root: as root it is started as the owner of the upstream's
socket folder when that is a Unix socket (the embedded Postgres of ``make test`` keeps its
socket in its 0700 data folder, owned by its own user), else as ``postgres`` (else
``nobody``), its folder handed to that user. It runs in the foreground as
our child and is stopped by its pid (SIGINT: a safe shutdown), never by name.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["PgBouncer", "binary", "DATABASE_ERRORS", "database_errors"]

#: Lines that mean a database error in a worker's (or beat's) log: the PgBouncer pass
#: (tests/conftest.py, MOTIR_TEST_SCAN_WORKER_LOGS=1) and bench/fleet.py fail on any.
#: (Not "raised unexpected": a task whose run ends in the DLQ raises RunFailed on purpose.)
DATABASE_ERRORS = ("psycopg.errors", "psycopg.OperationalError", "psycopg.InterfaceError", "sqlalchemy.exc.",
                   "DuplicatePreparedStatement", "prepared statement", "sweep failed", "lease renewal failed",
                   "the database refused its settle", "cron pass failed", "could not enqueue")


def database_errors(folder: Path) -> list[str]:
    """Every line of a ``*.log`` under ``folder`` naming a database error, prefixed by its file."""
    return [f"{log.relative_to(folder)}: {line.strip()[:300]}"
            for log in sorted(folder.rglob("*.log"))
            for line in log.read_text(errors="replace").splitlines()
            if any(p in line for p in DATABASE_ERRORS)]

#: Logins the engine's deployments use besides the URL's own user (trust: they need only be listed).
_EXTRA_USERS = ("postgres", "motir_engine", "motir_app", "motir_admin", "motir_owner")


def binary() -> str | None:
    """PgBouncer's executable (Debian puts it in /usr/sbin, often not on a user's PATH)."""
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None)
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _unprivileged_user(upstream_host: str) -> pwd.struct_passwd | None:
    """Whom to run PgBouncer as under root: one that can reach the upstream."""
    if upstream_host.startswith("/"):  # a socket folder: only its owner may be able to enter it
        try:
            owner = pwd.getpwuid(os.stat(upstream_host).st_uid)
        except (OSError, KeyError):
            owner = None
        if owner is not None and owner.pw_uid != 0:
            return owner
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


class PgBouncer:
    """One PgBouncer of our own. ``start()``, then ``url(...)``, ``show(...)``, ``stop()``."""

    def __init__(self, upstream_url: str, *, pool_size: int = 4, max_client_conn: int = 1000,
                 pool_mode: str = "transaction") -> None:
        from sqlalchemy import make_url

        url = make_url(upstream_url)
        # A Unix-socket URL (the embedded Postgres of `make test`: ?host=<dir>&port=N) works too.
        query = {k: (v[0] if isinstance(v, tuple) else v) for k, v in url.query.items()}
        self.upstream_host = url.host or query.get("host") or "127.0.0.1"
        self.upstream_port = url.port or int(query.get("port") or 5432)
        self.upstream = url.difference_update_query(["host", "port"])
        self.pool_size, self.max_client_conn, self.pool_mode = pool_size, max_client_conn, pool_mode
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="motir-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.user = self.upstream.username or "postgres"
        self._run_as: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            self._run_as = _unprivileged_user(self.upstream_host)

    # --- addresses -----------------------------------------------------------------

    def url(self, database: str | None = None, *, user: str | None = None) -> str:
        """``upstream_url`` with PgBouncer's host and port (and optionally another database)."""
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
        """``SHOW <what>`` on the admin console (simple protocol, autocommit), as dicts."""
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(self.admin_dsn(), autocommit=True, prepare_threshold=None,
                             row_factory=dict_row, connect_timeout=5) as conn:
            # The console speaks the simple query protocol only.
            return list(conn.execute(f"SHOW {what}".encode(), prepare=False).fetchall())

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.dir / "pgbouncer.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # --- life --------------------------------------------------------------------------

    def _config(self) -> str:
        host, port = self.upstream_host, self.upstream_port
        return "\n".join([
            "[databases]",
            # Any database name routes to the same server: a session's new database is reachable at once.
            f"* = host={host} port={port}",
            "",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            f"unix_socket_dir = {self.dir}",
            "auth_type = trust",
            f"auth_file = {self.dir / 'users.txt'}",
            # Logins a test creates at runtime are looked up on the server (auth_query, as this user).
            f"auth_user = {self.user}",
            f"admin_users = {self.user}",
            f"stats_users = {self.user}",
            f"pool_mode = {self.pool_mode}",
            f"default_pool_size = {self.pool_size}",
            "min_pool_size = 0",
            "reserve_pool_size = 0",
            f"max_client_conn = {self.max_client_conn}",
            # psycopg sends neither, but other clients (JDBC, some drivers) do.
            "ignore_startup_parameters = extra_float_digits,options",
            # Clients wait for a server connection rather than fail: a bounded pool queues.
            "query_wait_timeout = 120",
            f"logfile = {self.dir / 'pgbouncer.log'}",
            f"pidfile = {self.dir / 'pgbouncer.pid'}",
            "log_connections = 0",
            "log_disconnections = 0",
            "",
        ])

    def start(self, timeout: float = 20) -> "PgBouncer":
        exe = binary()
        if exe is None:
            raise RuntimeError("pgbouncer is not installed (Debian: apt-get install pgbouncer; "
                               "`make test` installs it as root, see .ci/system-packages)")
        users = sorted({self.user, *_EXTRA_USERS})
        (self.dir / "users.txt").write_text("".join(f'"{u}" ""\n' for u in users))
        (self.dir / "pgbouncer.ini").write_text(self._config())
        if self._run_as is not None:
            os.chmod(self.dir, 0o755)
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, self._run_as.pw_uid, self._run_as.pw_gid)
        log = open(self.dir / "stderr.log", "wb")
        self.proc = subprocess.Popen([exe, str(self.dir / "pgbouncer.ini")], stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=self._demote, start_new_session=True, cwd=self.dir)
        log.close()
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

    def _demote(self) -> None:
        if self._run_as is not None:
            os.setgid(self._run_as.pw_gid)
            os.initgroups(self._run_as.pw_name, self._run_as.pw_gid)
            os.setuid(self._run_as.pw_uid)

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

    def __enter__(self) -> "PgBouncer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.pgbouncer", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run COMMAND with MOTIR_DATABASE_URL through a private PgBouncer")
    run.add_argument("--pool-size", type=int, default=int(os.environ.get("MOTIR_PGBOUNCER_POOL_SIZE", "4")))
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("run: a COMMAND is needed after --")
    upstream = os.environ.get("MOTIR_DATABASE_URL")
    if not upstream:
        parser.error("MOTIR_DATABASE_URL must name the Postgres server PgBouncer fronts")
    bouncer = PgBouncer(upstream, pool_size=args.pool_size).start()
    print(f"pgbouncer: transaction pooling on 127.0.0.1:{bouncer.port} -> "
          f"{bouncer.upstream_host}:{bouncer.upstream_port}, default_pool_size={args.pool_size}",
          file=sys.stderr)
    env = dict(os.environ, MOTIR_DATABASE_URL=bouncer.url(), MOTIR_PREPARED_STATEMENTS="0",
               MOTIR_DIRECT_DATABASE_URL=upstream, MOTIR_PGBOUNCER_ADMIN=bouncer.admin_dsn())
    try:
        return subprocess.call(command, env=env)
    finally:
        stats = bouncer.show("STATS_TOTALS") if bouncer.proc else []
        # "got packet 'E' from server when not linked": the session's DROP DATABASE … WITH (FORCE)
        # ending PgBouncer's idle server connections to it, at the very end. Expected; not shown.
        errors = [ln for ln in bouncer.log_tail(10_000).splitlines()
                  if (" ERROR " in ln or "WARNING" in ln) and "when not linked" not in ln]
        bouncer.stop()
        total = sum(int(r.get("xact_count") or r.get("total_xact_count") or 0) for r in stats)
        print(f"pgbouncer: stopped; {total} transactions pooled, {len(errors)} ERROR/WARNING lines in its log",
              file=sys.stderr)
        for line in errors[-20:]:
            print(f"pgbouncer: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
