"""``motir doctor``: is this deployment able to run jobs? One line per check, each with its fix.

A FAIL means jobs do not run, or tenants are not kept apart, as configured; a WARN is a
set-up that works but is not one to deploy as it is (development mode, no admin login,
open DLQ entries). ``motir doctor`` exits 1 on a FAIL; ``--strict`` (deploy pipelines)
on a WARN too. Every check that is not OK says what to do.

Checks, in order (later ones are skipped when the database is unreachable):

1. database reachable — the engine URL, with a short connect timeout;
2. migrations at head — Alembic's version table against the shipped revisions
   (``motir migrate --check`` compares the whole schema, RLS policies and grants included);
3. roles — ``motir_app``, ``motir_admin`` and ``motir_engine`` exist;
4. row-level security — enabled with its two policies on each table, the
   roles' grants as declared (no UPDATE or DELETE for the app role), and
   *active* for the app connection (``row_security_active``); FAIL when
   ``MOTIR_APP_DATABASE_URL``'s login can leave the app role (a superuser,
   BYPASSRLS, the owner, the engine or an admin member that ``RESET ROLE``
   returns to), or is itself a member of ``motir_admin`` (it could set
   ``motir.system_admin`` for itself). Development mode (no
   ``MOTIR_APP_DATABASE_URL``: the engine's login drops to the app role with
   ``SET LOCAL ROLE``) is a WARN naming the roles ``RESET ROLE`` returns to: it
   catches mistakes, not attackers, which is what ``make run`` and the examples
   want and a deployment does not. The admin login (``MOTIR_ADMIN_DATABASE_URL``)
   must be a member of ``motir_admin`` and bypass nothing;
5. broker reachable;
6. workers alive — answer a Celery ping, consume this engine's queue, and know
   the jobs this process knows; a queue that has queued runs and no live
   consumer is named, with its count (a fleet whose workers all died); each
   inspection waits for every worker that answered the ping; a consumer whose
   task list came too late makes "knows none of these jobs" a WARN saying so;
7. sweeper recent — judged by its effect, since it keeps no heartbeat: no lease
   expired, and no due run left unpublished, for longer than the sweeper's
   period allows (the sweeper runs inside every worker);
8. queue — depth, and how long the oldest due run has waited;
9. DLQ — open entries (a warning: a decision is pending, nothing is broken).

Each check gets its own short-lived connection (``NullPool``) with a connect
timeout, so a dead host costs seconds, not minutes, and doctor never touches
the pools the rest of the process uses. Its statements are ``store/sql/reads.py``'s
(the doctor section) and ``store/sql/catalog.py``'s; ``motir doctor --statements``
lists every statement of the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

from sqlalchemy import create_engine, make_url
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from motir_celery.core.jobs import Job, all_jobs
from motir_celery.settings import Settings
from motir_celery.store import pooler
from motir_celery.store.db import set_workspace_context
from motir_celery.store.models import Base
from motir_celery.store.rls import ADMIN_ROLE, APP_ROLE, ENGINE_ROLE, compare_grants, policies_of
from motir_celery.store.sql import catalog, reads, session

__all__ = ["Check", "run_checks", "exit_status"]


@dataclass(frozen=True)
class Check:
    name: str
    #: "OK", "FAIL" or "WARN" (a warning fails ``motir doctor --strict`` only).
    status: str
    detail: str
    #: What to do; every check that is not OK has one.
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def fails(self, *, strict: bool = False) -> bool:
        """Whether this check fails ``motir doctor`` (``--strict``: a WARN does too)."""
        return self.status == "FAIL" or (strict and self.status == "WARN")


def exit_status(checks: list[Check], *, strict: bool = False) -> int:
    """``motir doctor``'s exit status: 1 when a check fails (with ``strict``, a WARN counts), else 0."""
    return 1 if any(c.fails(strict=strict) for c in checks) else 0


def _ok(name: str, detail: str) -> Check:
    return Check(name, "OK", detail)


def _fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, "FAIL", detail, fix)


def _engine(url: str, timeout: float) -> Engine:
    # prepare_threshold None: a few statements per one-shot connection gain nothing from being
    # prepared, and behind a transaction pooler (what the pooler check warns about) they would fail.
    return create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": max(1, int(timeout)),
                                                                "application_name": "motir-doctor",
                                                                "prepare_threshold": None})


def _where(url: str) -> str:
    u = make_url(url)
    return f"{u.host or 'local socket'}:{u.port or 5432}/{u.database} as {u.username or '(default user)'}"


def run_checks(settings: Settings, *, timeout: float = 3.0, max_wait: float = 300.0,
               app: Any = None) -> Iterator[Check]:
    """Yield each check as it completes. ``max_wait``: the oldest due run may wait this long.
    ``app``: the Celery app to check (``motir -A proj doctor``): its broker, default queue and
    workers instead of the environment's."""
    if app is not None:
        settings = dataclasses.replace(settings, broker_url=app.conf.broker_write_url or app.conf.broker_url,
                                       queue=app.conf.task_default_queue or settings.queue)
    if not settings.database_url:
        yield _fail("database", "MOTIR_DATABASE_URL is not set",
                    "export MOTIR_DATABASE_URL=postgresql+psycopg://motir_engine:…@host/db")
        db_ok = False
    else:
        engine = _engine(settings.database_url, timeout)
        try:
            with engine.connect() as conn:
                version = catalog.server_version(conn)
            # Which statement mode the engine is in (store/pooler.py: its probe, as a worker runs it).
            pooled = pooler.probe_url(settings.database_url, timeout=timeout) if settings.detect_pooler else None
            yield _ok("database", f"PostgreSQL {version} at {_where(settings.database_url)}; "
                                  f"{pooler.describe(settings, pooled)}")
            db_ok = True
        except Exception as exc:  # noqa: BLE001 — whatever it is, it is the answer
            yield _fail("database", f"cannot connect to {_where(settings.database_url)}: {_first_line(exc)}",
                        "check MOTIR_DATABASE_URL, that Postgres runs, and that this host may connect")
            db_ok = False

    if db_ok:
        yield from _database_checks(engine, settings, max_wait)
    else:
        for name in ("migrations", "roles", "row-level security", "sweeper", "queue", "dlq"):
            yield _fail(name, "skipped: the database is unreachable", "fix the database check first")

    waiting = _waiting_by_queue(engine, settings) if db_ok else {}
    yield from _celery_checks(settings, timeout, app, waiting)


def _waiting_by_queue(engine: Engine, settings: Settings) -> dict[str, int]:
    """Queued runs per Celery queue (a job's ``queue=``, else the engine's), to name those nobody consumes."""
    with engine.connect() as conn:
        per_job = reads.queued_by_job(conn)
    jobs = {j.id: j for j in all_jobs()}
    waiting: dict[str, int] = {}
    for job_id, n in per_job.items():
        job = jobs.get(job_id)
        queue = (job.options.get("queue") if job is not None else None) or settings.queue
        waiting[queue] = waiting.get(queue, 0) + n
    return waiting


def _database_checks(engine: Engine, settings: Settings, max_wait: float) -> Iterator[Check]:
    yield _migrations(engine, settings)
    yield _roles(engine, settings)
    yield _rls(engine, settings)
    with engine.connect() as conn:
        if (pooler := _pooler(conn, settings)) is not None:
            yield pooler
        yield _sweeper(conn, settings)
        yield _queue(conn, settings, max_wait)
        n = reads.dlq_open(conn)
    yield (_ok("dlq", "no open entries") if not n else
           Check("dlq", "WARN", f"{n} open entr{'y' if n == 1 else 'ies'} waiting for a decision",
                 "motir dlq list; then motir dlq replay ID --actor YOU (or dismiss)"))


def _migrations(engine: Engine, settings: Settings) -> Check:
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from motir_celery.store.migrate import alembic_config

    try:
        heads = set(ScriptDirectory.from_config(alembic_config(settings.require_database_url())).get_heads())
        with engine.connect() as conn:
            current = set(MigrationContext.configure(conn).get_current_heads())
    except Exception as exc:  # noqa: BLE001
        return _fail("migrations", f"cannot read the revision: {_first_line(exc)}", "motir migrate")
    if not current:
        return _fail("migrations", "the database is not migrated (no alembic_version)", "motir migrate")
    if current != heads:
        return _fail("migrations", f"at {', '.join(sorted(current))}; head is {', '.join(sorted(heads))}",
                     "motir migrate (as the owner: MOTIR_MIGRATE_DATABASE_URL)")
    return _ok("migrations", f"at head ({', '.join(sorted(heads))}); `motir migrate --check` compares the schema")


def _roles(engine: Engine, settings: Settings) -> Check:
    wanted = [APP_ROLE, ADMIN_ROLE, ENGINE_ROLE]
    with engine.connect() as conn:
        found = catalog.present_roles(conn, wanted)
    missing = [r for r in wanted if r not in found]
    if missing:
        return _fail("roles", f"missing: {', '.join(missing)}", "motir migrate creates them (needs CREATEROLE)")
    return _ok("roles", f"{', '.join(wanted)} exist")


def _rls(engine: Engine, settings: Settings) -> Check:
    declared = policies_of(Base.metadata)
    tables = sorted(declared)
    with engine.connect() as conn:
        flags = catalog.rls_flags(conn, tables)
        live = catalog.policy_names(conn, tables)
        grants = [f"{kind} {g.privilege}{f' ({g.column})' if g.column else ''} on {g.table} "
                  f"{'to' if kind == 'grant' else 'from'} {g.role}" for kind, g in compare_grants(conn, Base.metadata)]
    off = [t for t in tables if not flags.get(t)]
    absent = [f"{p.table}.{p.name}" for t in tables for p in declared[t] if f"{p.table}.{p.name}" not in live]
    if off or absent or grants:
        detail = "; ".join(x for x in (off and f"RLS off on {', '.join(off)}",
                                       absent and f"policies missing: {', '.join(absent)}",
                                       grants and f"grants drifted (needed: {', '.join(grants)})") if x)
        return _fail("row-level security", detail, "motir migrate --check shows the drift; motir migrate restores it")
    # Is RLS actually applied to what the dashboard and user code use?
    app_url = settings.app_database_url or settings.database_url
    assert app_url is not None
    app_engine = _engine(app_url, 3) if settings.app_database_url else engine
    try:
        with app_engine.begin() as conn:
            if not settings.app_database_url:
                session.reader_role(conn, APP_ROLE)  # SET LOCAL ROLE, as a workspace session does
            set_workspace_context(conn, "motir-doctor-probe")
            row = reads.rls_probe(conn)
            login, exits = reads.login_escapes(conn, engine_role=ENGINE_ROLE, admin_role=ADMIN_ROLE)
    except Exception as exc:  # noqa: BLE001
        how = "MOTIR_APP_DATABASE_URL" if settings.app_database_url else f"SET ROLE {APP_ROLE}"
        return _fail("row-level security", f"cannot open the app connection ({how}): {_first_line(exc)}",
                     "set MOTIR_APP_DATABASE_URL to a login of motir_app, or GRANT motir_app TO the engine login")
    if not row["active"] or row["bypass"]:
        return _fail("row-level security", f"NOT enforced for the app connection (user {row['who']}): "
                     "it would see every workspace",
                     "MOTIR_APP_DATABASE_URL must log in as motir_app (not a superuser, not BYPASSRLS)")
    if not settings.app_database_url:
        # Development mode works as intended (make run, the examples): a WARN, which
        # `motir doctor --strict` (a deploy pipeline) fails on.
        return Check("row-level security", "WARN",
                     f"development mode (no MOTIR_APP_DATABASE_URL): enforced for {row['who']} only while the engine's "
                     f"login ({login}) keeps SET LOCAL ROLE; RESET ROLE returns to {login} "
                     f"({', '.join(exits) or 'another role'}), so it catches mistakes, not an attacker",
                     "fine on a developer's machine; to deploy, set MOTIR_APP_DATABASE_URL to a login that is only "
                     "a member of motir_app (and MOTIR_ADMIN_DATABASE_URL for admin reads); "
                     "`motir doctor --strict` fails until then")
    if exits:
        return _fail("row-level security", f"the app login {login} can leave the app role: it is or may become "
                     f"{', '.join(exits)}",
                     f"log in as a role that is only a member of {APP_ROLE} "
                     f"(REVOKE the others FROM {login})")
    admin = _admin_login(settings)
    if admin is not None:
        return admin
    return _ok("row-level security", f"enabled on {len(tables)} tables, enforced for {row['who']} (login {login}, "
               f"which cannot leave it)")


def _admin_login(settings: Settings) -> Check | None:
    """A FAIL for an admin URL that is not a plain member of motir_admin; a WARN without one."""
    if not settings.admin_database_url:
        return Check("row-level security", "WARN", "enforced for the app login; no MOTIR_ADMIN_DATABASE_URL, so "
                     "admin reads (the CLI's, dashboard admins, metrics) are refused",
                     f"set MOTIR_ADMIN_DATABASE_URL to a login that is a member of {ADMIN_ROLE}")
    eng = _engine(settings.admin_database_url, 3)
    try:
        with eng.connect() as conn:
            login, exits = reads.login_escapes(conn, engine_role=ENGINE_ROLE, admin_role=ADMIN_ROLE)
    except Exception as exc:  # noqa: BLE001
        return _fail("row-level security", f"cannot open the admin connection: {_first_line(exc)}",
                     "check MOTIR_ADMIN_DATABASE_URL")
    finally:
        eng.dispose()
    admin_only = [e for e in exits if e.startswith(f"{ADMIN_ROLE} ")]
    others = [e for e in exits if e not in admin_only]
    if not admin_only:
        return _fail("row-level security", f"the admin login {login} is not a member of {ADMIN_ROLE}: admin reads "
                     "see nothing beyond one workspace", f"GRANT {ADMIN_ROLE} TO {login}")
    if others:
        return _fail("row-level security", f"the admin login {login} can also become {', '.join(others)}",
                     f"log in as a role that is only a member of {ADMIN_ROLE}")
    return None


def _pooler(conn: Any, settings: Settings) -> Check | None:
    """Through a pooler (PgBouncer) the server sees another connection than the URL names (another
    port, or a Unix socket behind a TCP URL): then prepared statements must be off if it pools
    transactions. None when direct."""
    url = make_url(settings.database_url or "")
    query = {k: (v[-1] if isinstance(v, tuple) else v) for k, v in url.query.items()}
    host = url.host or query.get("host") or ""
    if not host or host.startswith("/"):
        return None  # the URL names a Unix socket: a connection to the server itself, as far as we can tell
    url_port = url.port or int(query.get("port") or 5432)
    server_port = catalog.server_port(conn)
    if server_port == url_port:
        return None  # direct: nothing to say
    # NULL: the server sees a Unix-socket connection, though this process connected over TCP.
    server = f"listens on {server_port}" if server_port is not None else "sees a Unix-socket connection"
    where = (f"MOTIR_DATABASE_URL names port {url_port}, the server {server}: "
             "a pooler or proxy sits in between")
    if not settings.prepared_statements:
        return _ok("pooler", where + "; prepared statements are off, as transaction pooling needs")
    if settings.detect_pooler:  # the engine probes for itself (always, from the environment)
        return _ok("pooler", where + "; " + pooler.describe(settings, pooler.probe_url(settings.database_url or "")))
    return Check("pooler", "WARN", where + " and this process's settings prepare statements without probing",
                 "behind PgBouncer in transaction mode the engine must find the pooler (detect_pooler, the "
                 "default; docs/operations.md, Behind PgBouncer)")


def _sweeper(conn: Any, settings: Settings) -> Check:
    # Allow three sweeper periods (plus slack) past each deadline before blaming it.
    grace = 3 * settings.sweep_interval + 5
    row = reads.sweeper_overdue(conn, grace=grace, republish_after=settings.republish_after)
    if row["stale_leases"] or row["unpublished"]:
        parts = []
        if row["stale_leases"]:
            parts.append(f"{row['stale_leases']} run(s) with a lease expired over {grace:.0f}s ago")
        if row["unpublished"]:
            parts.append(f"{row['unpublished']} due run(s) not re-published for over "
                         f"{settings.republish_after + grace:.0f}s")
        return _fail("sweeper", "; ".join(parts) + ": no sweeper has run lately",
                     "the sweeper runs inside every worker: start `celery -A motir_celery worker`")
    return _ok("sweeper", f"nothing overdue (no lease expired >{grace:.0f}s ago, no lost message)")


def _queue(conn: Any, settings: Settings, max_wait: float) -> Check:
    row = reads.queue_summary(conn)
    from motir_celery.ops.timefmt import format_duration

    oldest = float(row["oldest"]) if row["oldest"] is not None else None
    detail = f"{row['queued']} queued ({row['due']} due), {row['running']} running; oldest due run "
    detail += f"({row['oldest_job']}) waiting {format_duration(oldest)}" if oldest is not None else "waiting -"
    if oldest is not None and oldest > max_wait:
        return _fail("queue", detail + f" (over {format_duration(max_wait)})",
                     f"workers are not keeping up, not consuming queue {settings.queue!r}, or do not import "
                     f"{row['oldest_job']!r} (MOTIR_IMPORTS): check `celery -A motir_celery inspect active_queues` "
                     "and `inspect registered`, or add workers")
    return _ok("queue", detail)


def _celery_checks(settings: Settings, timeout: float, app: Any = None,
                   waiting: dict[str, int] | None = None) -> Iterator[Check]:
    if not settings.broker_url:
        yield _fail("broker", "CELERY_BROKER_URL is not set", "export CELERY_BROKER_URL=redis://host:6379/0")
        yield _fail("workers", "skipped: no broker", "fix the broker check first")
        return
    from kombu import Connection  # type: ignore[attr-defined]  # kombu is untyped

    try:
        with Connection(settings.broker_url, connect_timeout=timeout) as conn:  # type: ignore[no-untyped-call]
            conn.ensure_connection(max_retries=1, timeout=timeout)
            where = conn.as_uri()  # password masked
        yield _ok("broker", f"reachable at {where}")
    except Exception as exc:  # noqa: BLE001
        yield _fail("broker", f"unreachable: {_first_line(exc)}", "check CELERY_BROKER_URL and that the broker runs")
        yield _fail("workers", "skipped: the broker is unreachable", "fix the broker check first")
        return
    yield _workers(settings, timeout, app, waiting or {})


def _unconsumed(waiting: dict[str, int], consuming: dict[str, set[str]], default: str) -> str:
    """The queues with queued runs (and the engine's own) that no live worker consumes, with their counts."""
    live = {q for queues in consuming.values() for q in queues}
    queues = sorted(q for q in {default, *waiting} if q not in live)
    return ", ".join(f"{q!r} ({waiting.get(q, 0)} run(s) queued)" for q in queues)


def _workers(settings: Settings, timeout: float, given: Any = None, waiting: dict[str, int] | None = None) -> Check:
    from motir_celery.adapter.celery_app import control_app

    app = given if given is not None else control_app(settings)
    try:
        # A ping reaches every worker on the broker, other apps' too: only those that
        # consume this engine's queue count, and only their task registries.
        replies = app.control.ping(timeout=timeout) or []
        names = sorted(name for reply in replies for name in reply)
        start_one = (f"start one: celery -A {given.main if given is not None else 'motir_celery'} worker "
                     f"-Q {settings.queue} "
                     "(with MOTIR_IMPORTS naming your job modules)")
        waiting = waiting or {}
        if not names:
            return _fail("workers", f"no worker answered a ping within {timeout:g}s: no live consumer on queue(s) "
                         f"{_unconsumed(waiting, {}, settings.queue)}", start_one)
        # Each inspection returns once every worker that answered the ping has replied (limit),
        # else after the whole timeout: a loaded worker's late reply must not read as "consumes
        # nothing" or "knows no job".
        inspect = app.control.inspect(destination=names, limit=len(names), timeout=timeout)
        consuming = {w: {q["name"] for q in qs} for w, qs in (inspect.active_queues() or {}).items()}
        registered = {w: set(ts) for w, ts in (inspect.registered() or {}).items()}
        # A worker that answered the ping but not `active_queues` in time may be another app's,
        # or ours and busy: a queue nobody is seen to consume stays a FAIL (an outage must not pass
        # a health check), and the detail names the silent ones.
        silent = [w for w in names if w not in consuming]
        late = (f" ({', '.join(silent[:4])}{'…' if len(silent) > 4 else ''} answered the ping, not `inspect` "
                f"within {timeout:g}s: if one is yours, run doctor again with a longer --timeout)") if silent else ""
        serving = sorted(w for w, queues in consuming.items() if settings.queue in queues)
        if not serving:
            return _fail("workers", f"{len(names)} worker(s) answered, none consumes queue {settings.queue!r}: "
                         f"no live consumer on queue(s) {_unconsumed(waiting, consuming, settings.queue)}{late}",
                         start_one)
        stranded = _unconsumed({q: n for q, n in waiting.items() if n}, consuming, settings.queue)
        if stranded:
            return _fail("workers", f"no live consumer on queue(s) {stranded}{late}",
                         "start a worker with -Q naming each of these queues")

        def known(job: Job) -> bool:
            # A job routed with define_job(..., queue=...) needs a worker on that queue.
            # (Routes set in the app's task_routes are not followed here.)
            queue = job.options.get("queue") or settings.queue
            return any(job.task_name in registered.get(w, set()) for w, qs in consuming.items() if queue in qs)

        unknown = [j.id for j in all_jobs() if not known(j)]
        tasks = {t for w in serving for t in registered.get(w, set()) if t.startswith("motir.")}
        detail = (f"{len(serving)} on queue {settings.queue!r} ({', '.join(serving[:4])}"
                  f"{'…' if len(serving) > 4 else ''}); {len(tasks)} motir job(s) registered")
        # A consumer whose `registered` reply did not come in time may know them: say so, a WARN,
        # rather than cry wolf about a busy worker.
        unsure = sorted(w for w in consuming if w not in registered)
        if unknown and unsure:
            return Check("workers", "WARN", detail + f"; none is seen to know {', '.join(unknown)}, but "
                         f"{', '.join(unsure[:4])}{'…' if len(unsure) > 4 else ''} did not answer `inspect registered` "
                         f"within {timeout:g}s, so this may be wrong",
                         f"motir doctor --timeout {max(10.0, 3 * timeout):g} (a busy worker answers late); if it "
                         "stays, set MOTIR_IMPORTS on the workers to the modules that define these jobs")
        if unknown:
            return _fail("workers", detail + f"; none knows {', '.join(unknown)}",
                         "set MOTIR_IMPORTS on the workers to the modules that define these jobs")
        return _ok("workers", detail)
    except Exception as exc:  # noqa: BLE001
        return _fail("workers", f"ping failed: {_first_line(exc)}", "check the broker and the workers' logs")
    finally:
        if given is None:
            app.close()


def _first_line(exc: BaseException) -> str:
    text_ = str(exc).strip().splitlines()
    return text_[0][:300] if text_ else type(exc).__name__
