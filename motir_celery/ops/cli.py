"""``motir``: the operator's command line (click, like Celery's own).

Every command prints a readable table by default and JSON with ``--json``
(stable keys, ISO timestamps, for scripts and ``jq``). Progress of long
operations goes to stderr, so ``--json`` output on stdout stays parseable.

Configuration is the environment, exactly as for workers (``settings.py``):
``MOTIR_DATABASE_URL``, ``CELERY_BROKER_URL``, ``MOTIR_IMPORTS``, … — and, with
``-A proj`` as for ``celery -A proj``, your Celery app: commands publish through
it and ``doctor`` checks its broker, queue and workers. Job modules are imported
from the current folder too, as a worker imports them.

Reads (``runs``, ``dlq list``) go through the app role with the admin context:
an operator at this prompt already holds database credentials, and sees every
workspace; ``--workspace`` narrows the listing. Writes (``send``, ``cancel``,
``dlq replay``) go through the engine's own functions, which audit and publish.
The reading URLs may name a hot standby; writes never use them. A read from a
standby that is behind the primary adds a one-line note on stderr (``_read_note``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
import sys
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterable, Sequence

import click

from motir_celery.core.operator import bulk
from motir_celery.core.operator import dlq as dlq_ops
from motir_celery.errors import MotirError
from motir_celery.ops import reads
from motir_celery.ops.timefmt import (
    describe_cron,
    format_ago,
    format_duration,
    format_instant,
    next_slots,
    parse_duration,
    parse_since,
)
from motir_celery.settings import Settings

__all__ = ["main"]

#: ``--older-than 0d`` (any unit): a period of zero, accepted by ``purge --dry-run`` only.
_ZERO = re.compile(r"\s*0+(?:\.0+)?\s*(?:s|m|min|h|d|w)\s*", re.IGNORECASE)


# --- output ------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        for prop in ("duration", "status", "open"):  # computed fields worth having in scripts
            if isinstance(getattr(type(value), prop, None), property):
                out[prop] = _jsonable(getattr(value, prop))
        return out
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def _print_json(value: Any) -> None:
    click.echo(json.dumps(_jsonable(value), indent=2, sort_keys=False))


def _cell(value: Any, width: int) -> str:
    text = "-" if value is None or value == "" else str(value)
    text = " ".join(text.split())  # one line per row, whatever the data holds
    return text if len(text) <= width else text[: width - 1] + "…"


def text_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, max_width: int = 60) -> str:
    """Plain aligned columns: readable in a terminal, greppable, no box drawing."""
    cells = [[_cell(v, max_width) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def _progress(message: str) -> None:
    click.echo(message, err=True)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


# --- plumbing ----------------------------------------------------------------------


class _Group(click.Group):
    """Turns expected failures (configuration, unreachable database) into one-line errors."""

    def invoke(self, ctx: click.Context) -> Any:
        from sqlalchemy.exc import OperationalError, ProgrammingError

        try:
            return super().invoke(ctx)
        except MotirError as exc:
            raise click.ClickException(str(exc)) from None
        except OperationalError as exc:
            raise click.ClickException(
                f"database unreachable: {str(exc.orig).strip().splitlines()[0] if exc.orig else exc}"
                " (check MOTIR_DATABASE_URL; `motir doctor` checks everything)"
            ) from None
        except ProgrammingError as exc:
            first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            hint = " — run `motir migrate`" if "does not exist" in first else ""
            raise click.ClickException(f"database error: {first}{hint}") from None


def _settings() -> Settings:
    """The current engine's settings (``-A``'s app's engine, else the environment's)."""
    import motir_celery

    return motir_celery.current_engine().settings


def _app() -> Any:
    """The Celery app given with ``-A`` (attached), or None: the environment's."""
    return click.get_current_context().find_root().meta.get("motir.app")


def _use_app(path: str) -> Any:
    """``-A``: find the app as ``celery -A`` does (the current folder on the path) and host the engine on it."""
    from celery import Celery
    from celery.app.utils import find_app

    import motir_celery

    try:
        app = find_app(path)
    except Exception as exc:  # noqa: BLE001 — no such module, no app in it: one line, as celery says it
        raise click.ClickException(f"-A {path}: cannot load the Celery app: {type(exc).__name__}: {exc}") from None
    if not isinstance(app, Celery):
        raise click.ClickException(f"-A {path}: {type(app).__name__} is not a Celery app")
    return motir_celery.attach(app)  # publish through it from now on (a no-op if its module attached it)


def _load_jobs(settings: Settings) -> None:
    """Import the job modules as a worker does — the Celery app's own (``imports``, ``include``,
    ``autodiscover_tasks()``), then MOTIR_IMPORTS: ``jobs``, ``send`` and replay need the registry."""
    from celery.utils.imports import import_from_cwd

    from motir_celery.adapter.messages import CeleryHost

    # The engine's own jobs (system.*), which every attached app registers on its workers.
    importlib.import_module("motir_celery.core.system_jobs")
    app = _app()
    if app is None:
        import motir_celery

        host = motir_celery.current_engine().built_host  # the app attach() hosted it on (Django: at setup)
        app = host.app if isinstance(host, CeleryHost) else None
    if app is not None:
        # What a worker does at start-up: Celery's autodiscovery and the app's imports (the
        # import_modules signal, which also imports MOTIR_IMPORTS for an attached app).
        app.loader.import_default_modules()
    for module in settings.imports:
        try:
            import_from_cwd(module)  # the current folder on the path while importing, as a worker does
        except ImportError as exc:
            raise click.ClickException(f"MOTIR_IMPORTS names {module!r}, which cannot be imported: {exc}") from None


def _operator_session(settings: Settings) -> Any:
    from motir_celery.store.db import workspace_session

    return workspace_session(None, admin=True, settings=settings)


def _read_note(read: reads.Freshness) -> None:
    """One line on stderr when the rows just read come from a standby that is behind."""
    if read.caught_up:
        return
    how = ("that is not connected to the primary, so it cannot tell how far behind it is" if not read.streaming
           else f"that is {reads.format_wal_bytes(read.behind_bytes)} of WAL behind the primary")
    age = (f"; the newest change it shows was committed {format_duration(read.replay_age)} ago"
           if read.replay_age is not None else "")
    _progress(f"note: read from a standby {how}{age}: recent changes may be missing")


def _text_option(value: str | None, param: str) -> str | None:
    """A filter option as ``reads.check_filter`` accepts it, or a one-line error naming it."""
    try:
        return reads.check_filter(param, value)
    except reads.FilterError as exc:
        raise click.BadParameter(str(exc).split(": ", 1)[1], param_hint=param) from None


def _actor(value: str) -> str:
    actor = value.strip()
    if not actor or len(actor) > 200 or not actor.isprintable():
        raise click.BadParameter("a printable name of at most 200 characters", param_hint="--actor")
    return actor


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    # FloatRange lets NaN through (it compares false with both bounds).
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def _uuid_arg(value: str, what: str) -> uuid.UUID:
    parsed = reads.as_uuid(value)
    if parsed is None:
        raise click.BadParameter(f"{value!r} is not a {what} id (a UUID)")
    return parsed


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="motir-celery", prog_name="motir")
@click.option("-A", "--app", "app_path", metavar="APP",
              help="Your Celery app, as `celery -A` takes it (proj, proj.celery:app): commands publish "
                   "through it; doctor checks its broker, queue and workers.")
@click.pass_context
def main(ctx: click.Context, app_path: str | None) -> None:
    """Operate motir-celery: durable jobs on Celery, with Postgres as the source of truth."""
    if app_path:
        ctx.meta["motir.app"] = _use_app(app_path)


# --- migrate ---------------------------------------------------------------------


@main.command()
@click.option("--check", is_flag=True, help="Only compare the database with the models (RLS policies and grants included); exit 1 on drift.")
@click.option("--set-role-passwords", is_flag=True,
              help="Give motir_app / motir_engine LOGIN with the passwords in $MOTIR_APP_PASSWORD / "
                   "$MOTIR_ENGINE_PASSWORD, and motir_admin with $MOTIR_ADMIN_PASSWORD when it is set "
                   "(never taken from the command line).")
@click.option("--to", "revision", default="head", show_default=True,
              help="Stop at this revision: the expand step of a rolling deploy (docs/operations.md, Deploy order).")
def migrate(check: bool, set_role_passwords: bool, revision: str) -> None:
    """Upgrade the schema to head (as the owner: MOTIR_MIGRATE_DATABASE_URL, else MOTIR_DATABASE_URL)."""
    from sqlalchemy import make_url

    from motir_celery.store import migrate as m

    settings = _settings()
    url = settings.migrate_database_url or settings.require_database_url()
    where = make_url(url).render_as_string(hide_password=True)
    if check:
        from alembic.util import AutogenerateDiffsDetected

        _progress(f"comparing {where} with the models…")
        try:
            m.check(url)
        except AutogenerateDiffsDetected as exc:
            raise click.ClickException(f"schema drift:\n{exc}") from None
        click.echo("no drift: the database matches the models, RLS policies and grants included")
        return
    _progress(f"upgrading {where} to {revision}…")
    m.upgrade(url, revision)
    click.echo(f"migrated: {where} is at {revision}")
    if set_role_passwords:
        _set_role_passwords(url, settings)


def _set_role_passwords(url: str, settings: Settings) -> None:
    import os

    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    from motir_celery.store.rls import ADMIN_ROLE, APP_ROLE, ENGINE_ROLE
    from motir_celery.store.sql import setup

    wanted = {APP_ROLE: "MOTIR_APP_PASSWORD", ENGINE_ROLE: "MOTIR_ENGINE_PASSWORD"}
    missing = [var for var in wanted.values() if not os.environ.get(var)]
    if missing:
        raise click.ClickException(f"--set-role-passwords needs {', '.join(missing)} in the environment")
    if os.environ.get("MOTIR_ADMIN_PASSWORD"):  # optional: a DBA may grant motir_admin to logins of their own
        wanted[ADMIN_ROLE] = "MOTIR_ADMIN_PASSWORD"
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            for role, var in wanted.items():
                # ALTER ROLE takes no bind parameters: store/sql/setup.py quotes with psycopg.
                setup.set_login_password(conn, role, os.environ[var])
                click.echo(f"role {role}: LOGIN, password from ${var}")
    finally:
        engine.dispose()


# --- send ------------------------------------------------------------------------


@main.command()
@click.argument("name")
@click.option("--data", "data_json", default="{}", show_default=True, help="Event data, a JSON document.")
@click.option("--workspace", help="Workspace id (default: data's workspace_id, else a system event).")
@click.option("--key", "idempotency_key", help="Idempotency key: a second send with it runs nothing.")
@json_option
def send(name: str, data_json: str, workspace: str | None, idempotency_key: str | None, as_json: bool) -> None:
    """Send event NAME: one run per subscribing job, published after commit."""
    from motir_celery import send_event
    from motir_celery.core.jobs import subscribers

    try:
        data = json.loads(data_json)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--data") from None
    workspace = _text_option(workspace, "--workspace")
    settings = _settings()
    _load_jobs(settings)
    if not subscribers(name):
        _progress(f"warning: no job subscribes to {name!r} in this process (MOTIR_IMPORTS="
                  f"{','.join(settings.imports) or 'unset'}); the event is recorded, nothing runs")
    result = send_event(name, data, workspace_id=workspace, idempotency_key=idempotency_key)
    runs = [{"job_id": r.job_id, "run_id": getattr(r, "run_id", None),
             "status": "queued" if hasattr(r, "run_id") else "already_queued"} for r in result.runs]
    if as_json:
        _print_json({"event_id": result.event_id, "deduplicated": result.deduplicated, "runs": runs})
        return
    if result.deduplicated:
        click.echo(f"deduplicated: key {idempotency_key!r} was already used for {name!r} "
                   f"(event {result.event_id}); nothing new runs")
        return
    click.echo(f"event {result.event_id}: {len(result.run_ids)} run(s) queued")
    if runs:
        click.echo(text_table(["job", "run", "status"], [(r["job_id"], r["run_id"], r["status"]) for r in runs]))


# --- runs ------------------------------------------------------------------------


@main.group()
def runs() -> None:
    """List runs, or show one in full."""


@runs.command("list")
@click.option("--job", help="Only this job id.")
@click.option("--state", type=click.Choice(["queued", "running", "succeeded", "failed", "cancelled"]))
@click.option("--workspace", help="Only this workspace.")
@click.option("--since", help="Created since: a duration back (30m, 2h, 7d) or an ISO date/time.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, reads.MAX_LIMIT))
@json_option
def runs_list(job: str | None, state: str | None, workspace: str | None, since: str | None, limit: int,
              as_json: bool) -> None:
    """Newest runs first."""
    job, workspace = _text_option(job, "--job"), _text_option(workspace, "--workspace")
    settings = _settings()
    with _operator_session(settings) as s:
        read = reads.freshness(s)
        now = read.now
        try:
            since_at = parse_since(since, now) if since else None
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--since") from None
        rows = reads.list_runs(s, job=job, state=state, workspace=workspace, since=since_at, limit=limit)
    _read_note(read)
    if as_json:
        _print_json(rows)
        return
    if not rows:
        click.echo("no runs match")
        return
    click.echo(text_table(
        ["run", "job", "workspace", "state", "attempts", "created", "took"],
        [(r.id, r.job_id, r.workspace_id or "system", r.state + (" (DLQ)" if r.in_dlq else ""),
          f"{r.attempts}/{r.max_attempts}", format_ago(r.created_at, now), format_duration(r.duration))
         for r in rows],
    ))


@runs.command("show")
@click.argument("run_id")
@click.option("--traceback", "tracebacks", is_flag=True, help="Print each failed attempt's traceback.")
@json_option
def runs_show(run_id: str, tracebacks: bool, as_json: bool) -> None:
    """One run: its event, steps with timings and outputs, attempts with errors and workers."""
    rid = _uuid_arg(run_id, "run")
    with _operator_session(_settings()) as s:
        d, read = reads.get_run(s, rid), reads.freshness(s)
    _read_note(read)
    if d is None:
        raise click.ClickException(f"no run {rid}")
    if as_json:
        _print_json(d)
        return
    r = d.run
    facts = [
        ("run", f"{r.id}  {r.state}"),
        ("job", r.job_id),
        ("event", f"{r.event_name}" + (f" ({d.event_id})" if d.event_id else "")),
        ("workspace", r.workspace_id or "system"),
        ("attempts", f"{r.attempts} of {r.max_attempts} ({r.retry_policy} policy)"),
        ("created", f"{format_instant(r.created_at)} ({format_ago(r.created_at, d.now)})"),
    ]
    if d.scheduled_for:
        facts.append(("cron slot", format_instant(d.scheduled_for)))
    if d.idempotency_key:
        facts.append(("idem. key", d.idempotency_key))
    if r.state == "queued":
        facts.append(("due", format_ago(r.run_at, d.now)))
    if r.state == "running":
        facts.append(("held by", f"{r.claimed_by}, lease {format_ago(d.lease_expires_at, d.now)}"))
    if r.finished_at:
        facts.append(("finished", f"{format_instant(r.finished_at)} (took {format_duration(r.duration)})"))
    if d.provider_key:
        facts.append(("provider", d.provider_key))
    if d.model_version:
        facts.append(("model", d.model_version))
    if d.dlq:
        e = d.dlq
        state = {"open": "OPEN — motir dlq replay " + str(e.id) + " --actor YOU",
                 "replayed": f"replayed by {e.replayed_by} at {format_instant(e.replayed_at)} → run {e.replay_run_id}",
                 "dismissed": f"dismissed by {e.dismissed_by} at {format_instant(e.dismissed_at)}",
                 "resumed": f"resumed by {e.resumed_by} at {format_instant(e.resumed_at)}"}[e.status]
        facts.append(("dlq", state))
    if d.replay_of:
        facts.append(("replay of", f"run {d.replay_of.run_id or '(purged)'}, by {d.replay_of.replayed_by}"))
    width = max(len(k) for k, _ in facts)
    for key, value in facts:
        click.echo(f"{key.ljust(width)}  {value}")
    click.echo(f"\nsteps ({len(d.steps)})")
    if d.steps:
        click.echo(text_table(["step", "attempt", "started", "took", "output"],
                          [(s.step_id, s.attempt, format_instant(s.started_at), format_duration(s.duration),
                            json.dumps(s.output, default=str)) for s in d.steps]))
    click.echo(f"\nattempts ({len(d.attempts)})")
    if d.attempts:
        # Numbered in order: a resume (motir dlq resume) starts the attempt budget afresh, so the
        # ledger's own number repeats; it is shown beside the order when they differ.
        click.echo(text_table(["#", "worker", "outcome", "started", "took", "error"],
                          [(_attempt_label(i, a.attempt), a.worker, a.outcome, format_instant(a.started_at),
                            format_duration(a.duration), _error_line(a.error))
                           for i, a in enumerate(d.attempts, 1)], max_width=80))
    if tracebacks:
        for i, a in enumerate(d.attempts, 1):
            if isinstance(a.error, dict) and a.error.get("traceback"):
                click.echo(f"\n--- attempt {_attempt_label(i, a.attempt)} traceback ---\n{a.error['traceback'].rstrip()}")
    if d.progress is not None:
        p = d.progress
        now = "" if p.current else ", not the running attempt's" if r.state == "running" else ", its last"
        click.echo(f"\nprogress  {p.state} {json.dumps(p.meta, default=str)}  "
                   f"(attempt {p.attempt}, {format_ago(p.updated_at, d.now)}{now})")
    if d.streams:
        click.echo(f"\nstreams ({len(d.streams)})")
        click.echo(text_table(["stream", "items", "last position", "last item"],
                              [(st.name, st.items, st.last, json.dumps(st.tail[-1][1], default=str) if st.tail else "")
                               for st in d.streams], max_width=80))
    if r.state == "succeeded":
        click.echo(f"\nresult  {json.dumps(d.result, default=str)}")


@runs.command("tree")
@click.argument("run_id")
@click.option("--depth", default=reads.TREE_DEPTH, show_default=True, type=click.IntRange(1, 32),
              help="Levels below the run.")
@click.option("--limit", default=reads.TREE_LIMIT, show_default=True, type=click.IntRange(1, reads.MAX_LIMIT),
              help="Runs listed at most.")
@json_option
def runs_tree(run_id: str, depth: int, limit: int, as_json: bool) -> None:
    """A run and the runs it started, as a tree: a canvas's links and members, a gather's children."""
    rid = _uuid_arg(run_id, "run")
    with _operator_session(_settings()) as s:
        tree, read = reads.get_tree(s, rid, depth=depth, limit=limit), reads.freshness(s)
    _read_note(read)
    if tree is None:
        raise click.ClickException(f"no run {rid}")
    if as_json:
        _print_json(tree)
        return
    click.echo(f"{tree.run_id}  {tree.job_id}  {tree.state}" + (f"\n{tree.outline}" if tree.outline else ""))
    counts = ", ".join(f"{n} {state}" for state, n in sorted(tree.counts.items()))
    click.echo(f"{tree.children} run(s) started by it" + (f": {counts}" if counts else ""))
    if tree.nodes:
        click.echo(text_table(["step", "run", "job", "state", "result"],
                              [("· " * (n.depth - 1) + (n.step_id or ""),  # one dot per level below the run
                                n.run_id, n.job_id, n.state, n.result or "") for n in tree.nodes], max_width=70))
    if tree.truncated:
        click.echo(f"(the first {len(tree.nodes)} shown: --limit for more)")


def _error_line(error: Any) -> str:
    if not isinstance(error, dict):
        return ""
    kind = str(error.get("type", "")).rsplit(".", 1)[-1]
    return f"{kind}: {error.get('message', '')}" if kind else str(error.get("message", ""))


# --- dlq -------------------------------------------------------------------------


@main.group()
def dlq() -> None:
    """The dead-letter queue: runs that exhausted their retries."""


@dlq.command("list")
@click.option("--all", "include_closed", is_flag=True, help="Include replayed and dismissed entries.")
@click.option("--job", help="Only this job id.")
@click.option("--workspace", help="Only this workspace.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, reads.MAX_LIMIT))
@json_option
def dlq_list(include_closed: bool, job: str | None, workspace: str | None, limit: int, as_json: bool) -> None:
    """Open entries, newest failure first."""
    job, workspace = _text_option(job, "--job"), _text_option(workspace, "--workspace")
    with _operator_session(_settings()) as s:
        read = reads.freshness(s)
        now = read.now
        entries = reads.list_dlq(s, include_closed=include_closed, job=job, workspace=workspace, limit=limit)
    _read_note(read)
    if as_json:
        _print_json(entries)
        return
    if not entries:
        click.echo("the dead-letter queue is empty" if include_closed else "no open entries")
        return
    click.echo(text_table(
        ["id", "job", "workspace", "status", "attempts", "failed", "error"],
        [(e.id, e.function_id, e.workspace_id or "system",
          e.status + (f" by {e.replayed_by or e.dismissed_by}" if not e.open else ""), e.attempts,
          format_ago(e.last_failed_at, now), e.error_message) for e in entries],
    ))


def _bulk_options(fn: Callable[..., None]) -> Callable[..., None]:
    """Without DLQ_ID: every open entry matching the filters (core/bulk.py)."""
    for option in reversed([
        click.option("--job", help="Bulk: only entries of this job id."),
        click.option("--error", "error_text", help="Bulk: the failure's 'type: message' contains this (any case)."),
        click.option("--since", help="Bulk: failed since (30m, 2h, 7d, or an ISO date/time)."),
        click.option("--until", help="Bulk: failed before (a duration back, or an ISO date/time)."),
        click.option("--workspace", help="Bulk: only this workspace."),
        click.option("--dry-run", is_flag=True, help="Bulk: print how many entries match, and a sample; change nothing."),
        click.option("--rate", default="10/s", show_default=True, help="Bulk: at most N entries per second (N or N/s)."),
        click.option("--limit", default=bulk.DEFAULT_LIMIT, show_default=True, type=click.IntRange(1, bulk.MAX_LIMIT),
                     help="Bulk: at most this many entries in one call."),
    ]):
        fn = option(fn)
    return fn


def _rate(value: str) -> float:
    raw = value.strip().removesuffix("/s")
    try:
        rate = float(raw)
    except ValueError:
        rate = float("nan")
    if not math.isfinite(rate) or not 0 < rate <= 10_000:
        raise click.BadParameter("a number of entries per second, more than 0 and at most 10000 (e.g. 10 or 10/s)",
                                 param_hint="--rate")
    return rate


def _bulk(action: "bulk.Action", actor: str, opts: dict[str, Any], as_json: bool) -> None:
    import motir_celery

    engine = motir_celery.current_engine()
    settings = engine.settings
    names = {"job": "--job", "error_text": "--error", "workspace": "--workspace"}
    text_opts = {k: _text_option(opts[k], names[k]) for k in names}
    with _operator_session(settings) as s:
        read = reads.freshness(s)
        now = read.now
    # The entries are matched on this reader too: an entry the standby has not replayed yet is not acted on.
    _read_note(read)
    instants: dict[str, datetime | None] = {}
    for key in ("since", "until"):
        try:
            instants[key] = parse_since(opts[key], now) if opts[key] else None
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=f"--{key}") from None
    flt = bulk.DlqFilter(job=text_opts["job"], error=text_opts["error_text"], workspace=text_opts["workspace"],
                         since=instants["since"], until=instants["until"])
    if flt.empty:
        raise click.UsageError("give a DLQ_ID, or at least one filter (--job, --error, --since, --until, "
                               "--workspace) to act on every open entry matching it")
    rate = _rate(opts["rate"])
    if action == "replay":
        _load_jobs(settings)
    caller = dlq_ops.Caller(actor, None, admin=True)
    verb = {"replay": "replayed", "resume": "resumed", "dismiss": "dismissed"}[action]
    result = bulk.bulk_dlq(engine, action, flt, caller=caller, dry_run=opts["dry_run"], rate=rate,
                           limit=opts["limit"])
    if as_json:
        _print_json(result)
        return
    if result.dry_run:
        click.echo(f"dry run: {result.matched} open entr{'y' if result.matched == 1 else 'ies'} would be {verb}"
                   + (f" (the first {opts['limit']}; run again for the rest)" if result.matched == opts["limit"] else ""))
    else:
        counts = ", ".join(f"{status} {n}" for status, n in sorted(result.counts.items())) or "nothing matched"
        click.echo(f"{action} by {actor}, at most {rate:g}/s: {result.matched} matched — {counts}")
    if result.sample:
        click.echo(text_table(["id", "job", "workspace", "failed", "error"],
                          [(e["id"], e["job"], e["workspace"] or "system", format_ago(e["failed_at"], now),
                            e["error"]) for e in result.sample]))


def _single_only(dlq_id: str | None, opts: dict[str, Any]) -> str:
    given = [f"--{k.replace('_text', '').replace('_', '-')}" for k in ("job", "error_text", "since", "until",
                                                                        "workspace") if opts[k]]
    if opts["dry_run"]:
        given.append("--dry-run")
    if given:
        raise click.UsageError(f"{', '.join(given)} select entries in bulk: give them without a DLQ_ID")
    assert dlq_id is not None
    return dlq_id


@dlq.command("replay")
@click.argument("dlq_id", required=False)
@click.option("--actor", required=True, help="Who is replaying (recorded as replayed_by).")
@click.option("--key", "idempotency_key", help="A new idempotency key (needed when the original event had one).")
@_bulk_options
@json_option
def dlq_replay(dlq_id: str | None, actor: str, idempotency_key: str | None, as_json: bool, **opts: Any) -> None:
    """Run the failed job again on the original event data — that job only — audited as ACTOR.

    Without DLQ_ID: every open entry matching the filters, paced by --rate."""
    from motir_celery import replay_dlq

    actor = _actor(actor)
    if dlq_id is None:
        if idempotency_key is not None:
            raise click.UsageError("--key replays one entry: give its DLQ_ID")
        return _bulk("replay", actor, opts, as_json)
    did = _uuid_arg(_single_only(dlq_id, opts), "DLQ entry")
    _load_jobs(_settings())
    result = replay_dlq(did, actor=actor, idempotency_key=idempotency_key)
    if as_json:
        _print_json(result)
    else:
        messages = {
            "replayed": f"replayed by {actor}: new run {result.run_id}",
            "already_replayed": f"already replayed earlier: run {result.run_id}",
            "dismissed": "this entry was dismissed; it cannot be replayed",
            "resumed": f"this entry was resumed (run {result.run_id}); it cannot be replayed",
            "deduplicated": "the event's idempotency key was already used, so nothing ran; "
                            "replay again with --key NEW-KEY",
            "not_found": f"no DLQ entry {did}",
        }
        click.echo(messages[result.status])
        if result.status == "replayed":
            _progress("the new run is queued: it runs when a worker consuming its job's queue takes it "
                      "(`motir doctor` says whether one does)")
    if result.status not in ("replayed", "already_replayed"):
        sys.exit(1)


@dlq.command("resume")
@click.argument("dlq_id", required=False)
@click.option("--actor", required=True, help="Who is resuming (recorded as resumed_by).")
@_bulk_options
@json_option
def dlq_resume(dlq_id: str | None, actor: str, as_json: bool, **opts: Any) -> None:
    """Queue the failed run again from its failed step — its stored steps are kept, its
    attempts start afresh — audited as ACTOR. Fix the cause first.

    Without DLQ_ID: every open entry matching the filters, paced by --rate."""
    from motir_celery import resume_dlq

    actor = _actor(actor)
    if dlq_id is None:
        return _bulk("resume", actor, opts, as_json)
    did = _uuid_arg(_single_only(dlq_id, opts), "DLQ entry")
    result = resume_dlq(did, actor=actor)
    if as_json:
        _print_json(result)
    else:
        click.echo({
            "resumed": f"resumed by {actor}: run {result.run_id} is queued again from its failed step",
            "already_resumed": f"already resumed earlier: run {result.run_id}",
            "replayed": "this entry was replayed; it cannot be resumed",
            "dismissed": "this entry was dismissed; it cannot be resumed",
            "purged": "the failed run was purged; replay the entry instead",
            "not_found": f"no DLQ entry {did}",
        }[result.status])
    if result.status not in ("resumed", "already_resumed"):
        sys.exit(1)


@dlq.command("dismiss")
@click.argument("dlq_id", required=False)
@click.option("--actor", required=True, help="Who decided not to replay (recorded as dismissed_by).")
@_bulk_options
@json_option
def dlq_dismiss(dlq_id: str | None, actor: str, as_json: bool, **opts: Any) -> None:
    """Close an entry without replaying it; purge may then delete it.

    Without DLQ_ID: every open entry matching the filters."""
    import motir_celery
    from motir_celery.core.operator.dlq import dismiss_dlq

    actor = _actor(actor)
    if dlq_id is None:
        return _bulk("dismiss", actor, opts, as_json)
    did = _uuid_arg(_single_only(dlq_id, opts), "DLQ entry")
    if dismiss_dlq(motir_celery.current_engine(), did, actor=actor):
        click.echo(f"dismissed by {actor}")
    else:
        raise click.ClickException(f"DLQ entry {did} does not exist or is already replayed, resumed or dismissed")


# --- cancel ----------------------------------------------------------------------


@main.command()
@click.argument("run_id", required=False)
@click.option("--workspace", help="Offboarding: every queued (sleeping, waiting) and running run of this workspace.")
@click.option("--job", help="With --workspace: that job's runs only.")
@click.option("--subject", metavar="TYPE:ID",
              help="With --workspace: the runs of that subject only (what their producer named with subject=).")
@click.option("--actor", help="With --workspace: who is cancelling (recorded on each run).")
@click.option("--reason", help="With --workspace: why (recorded on each run).")
@json_option
def cancel(run_id: str | None, workspace: str | None, job: str | None, subject: str | None, actor: str | None,
           reason: str | None, as_json: bool) -> None:
    """Cancel a queued or running run (a running one stops at its next step boundary); with
    --workspace, every one of a workspace (or of one job or one subject in it) at once, audited
    (--actor and --reason required)."""
    from motir_celery import cancel_run

    if workspace is not None:
        if run_id is not None:
            raise click.UsageError("give a RUN or --workspace, not both")
        if subject is not None:
            if job is not None:
                raise click.UsageError("give --job or --subject, not both")
            _cancel_subject(workspace, subject, actor, reason, as_json)
            return
        _cancel_workspace(workspace, job, actor, reason, as_json)
        return
    if run_id is None:
        raise click.UsageError("give the RUN to cancel, or --workspace")
    if job is not None or subject is not None or actor is not None or reason is not None:
        raise click.UsageError("--job, --subject, --actor and --reason go with --workspace")
    rid = _uuid_arg(run_id, "run")
    if cancel_run(rid):
        click.echo(f"cancelled {rid}")
        return
    with _operator_session(_settings()) as s:
        detail, read = reads.get_run(s, rid), reads.freshness(s)
    _read_note(read)  # a standby behind the primary may not have the run yet
    if detail is None:
        raise click.ClickException(f"no run {rid}")
    raise click.ClickException(f"run {rid} is already {detail.run.state}; only queued or running runs can be cancelled")


def _cancel_workspace(workspace: str, job: str | None, actor: str | None, reason: str | None, as_json: bool) -> None:
    import motir_celery
    from motir_celery.core.operator.offboard import cancel_workspace

    if actor is None or reason is None:
        raise click.UsageError("--workspace needs --actor (who) and --reason (why): both are recorded on each run")
    try:
        done = cancel_workspace(motir_celery.current_engine(), workspace, actor=actor, reason=reason, job=job)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        _print_json({"workspace": done.workspace_id, "job": done.job, "cancelled": done.cancelled,
                     "running": done.running, "actor": done.actor, "reason": done.reason})
        return
    click.echo(f"cancelled {done.cancelled} run(s) of workspace {workspace}" + (f", job {job}" if job else "")
               + f" ({done.running} running: each stops at its next step), by {actor}: {reason}")


def _cancel_subject(workspace: str, subject: str, actor: str | None, reason: str | None, as_json: bool) -> None:
    import motir_celery
    from motir_celery.core.operator.offboard import cancel_subject
    from motir_celery.core.shapes import parse_subject

    if actor is None or reason is None:
        raise click.UsageError("--subject needs --actor (who) and --reason (why): both are recorded on each run")
    try:
        done = cancel_subject(motir_celery.current_engine(), workspace, parse_subject(subject), actor=actor,
                              reason=reason)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        _print_json({"workspace": done.workspace_id, "subject_type": done.subject_type,
                     "subject_id": done.subject_id, "cancelled": done.cancelled, "running": done.running,
                     "actor": done.actor, "reason": done.reason})
        return
    click.echo(f"cancelled {done.cancelled} run(s) of subject {done.subject_type}:{done.subject_id} in workspace "
               f"{workspace} ({done.running} running: each stops at its next step), by {actor}: {reason}")


@main.command()
@click.option("--workspace", required=True, help="The workspace whose whole history is written.")
@click.option("--output", "-o", type=click.File("w"), default="-", show_default=True,
              help="The file to write (JSON lines: {\"table\": ..., \"row\": {...}}).")
def export(workspace: str, output: Any) -> None:
    """Offboarding: write every row of a workspace (events, runs, steps, attempts, DLQ entries, batch
    items, progress, stream items, stats rollup) as JSON lines; the count per table on stderr."""
    import motir_celery
    from motir_celery.core.operator.offboard import export_workspace

    try:
        counts = export_workspace(motir_celery.current_engine(), workspace, output)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    _progress("exported " + ", ".join(f"{table} {n}" for table, n in counts.items()))


@main.command()
@click.option("--workspace", required=True, help="The workspace to erase (nothing of it queued or running).")
@click.option("--actor", required=True, help="Who erases it (recorded in the audit event).")
@click.option("--reason", required=True, help="Why (recorded in the audit event).")
@json_option
def erase(workspace: str, actor: str, reason: str, as_json: bool) -> None:
    """Offboarding: delete every row of a workspace, table by table, in one transaction, checked
    complete (0 rows left in each), audited as the system event motir.workspace.erased. Refused
    while the workspace has queued or running runs (motir cancel --workspace first)."""
    import motir_celery
    from motir_celery.core.operator.offboard import IncompleteErase, WorkspaceActive, erase_workspace

    try:
        done = erase_workspace(motir_celery.current_engine(), workspace, actor=actor, reason=reason)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except (WorkspaceActive, IncompleteErase) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        _print_json({"workspace": workspace, "deleted": done.before, "left": done.after, "actor": actor,
                     "reason": reason})
        return
    click.echo(f"erased workspace {workspace} by {actor}: " + ", ".join(f"{t} {n}" for t, n in done.before.items())
               + " (0 rows left in each)")


# --- rollback ----------------------------------------------------------------------


@main.command()
@click.option("--job", "job_ids", multiple=True, metavar="JOB", help="A direct job (its id or task name); repeat it.")
@click.option("--all", "every", is_flag=True, help="Every direct job.")
@click.option("--dry-run", is_flag=True, help="Say what would be done; change nothing.")
@click.option("--no-purge", is_flag=True, help="Leave the queues as they are (the run messages in them too).")
@json_option
def rollback(job_ids: tuple[str, ...], every: bool, dry_run: bool, no_purge: bool, as_json: bool) -> None:
    """The way back to plain Celery: purge the run messages of the jobs' queues, then cancel each
    queued run and re-send its work as a plain Celery message (same task name and arguments), in one
    step per run. Run it after stopping the workers of this release, before starting the old ones."""
    from motir_celery.adapter.celery_app import default_app
    from motir_celery.adapter.rollback import direct_jobs, roll_back

    if every == bool(job_ids):
        raise click.UsageError("name the jobs (--job JOB, repeated) or give --all")
    import motir_celery

    _load_jobs(_settings())
    try:
        jobs = direct_jobs(None if every else job_ids)
    except LookupError as exc:
        raise click.ClickException(str(exc)) from None
    app = _app() or default_app()
    report = roll_back(motir_celery.current_engine(), app, jobs, dry_run=dry_run, purge=not no_purge)
    if as_json:
        _print_json(dataclasses.asdict(report))
    else:
        would = "would " if dry_run else ""
        for queue, length in sorted(report.queues.items()):
            click.echo(f"queue {queue}: {length} message(s) before")
        if not no_purge:
            click.echo(f"{would}purge the run messages" if dry_run else
                       f"purged {report.purged} run message(s), put {report.kept} other message(s) back")
        for run_id, name, task_id in report.resent:
            click.echo(f"{would}cancel run {run_id}; {would}send {name} as task {task_id}")
        if report.with_steps:
            click.echo(f"{len(report.with_steps)} of them had stored steps: the plain task runs its body from the top")
        for run_id in report.running:
            click.echo(f"run {run_id} is running: left to its worker (a warm shutdown finishes it)")
        for run_id, why in report.failed:
            click.echo(f"run {run_id} NOT handed back (still queued): {why}", err=True)
    if report.failed:
        raise SystemExit(1)


# --- jobs ------------------------------------------------------------------------


@main.command()
@click.option("--slots", default=3, show_default=True, type=click.IntRange(0, 20), help="Next cron slots to show.")
@json_option
def jobs(slots: int, as_json: bool) -> None:
    """The job registry (the Celery app's task modules, MOTIR_IMPORTS): triggers, cron and its next slots, retry policy."""
    from motir_celery.core.jobs import all_jobs

    settings = _settings()
    _load_jobs(settings)
    registry = all_jobs()
    # Display only: the local clock is fine here; the engine decides slots on the database's.
    now = datetime.now(timezone.utc)
    out = []
    for job in registry:
        p = job.retry_policy
        entry: dict[str, Any] = {
            "id": job.id, "task": job.task_name, "events": list(job.events), "cron": job.cron,
            "timezone": job.timezone if job.cron else None,
            "schedule": describe_cron(job.cron) if job.cron else None,
            "next_slots": [s.isoformat() for s in next_slots(job.cron, job.timezone, now, slots)] if job.cron else [],
            "retry_policy": {"name": p.name, "max_attempts": p.max_attempts, "backoff": p.backoff,
                             "factor": p.factor, "max_backoff": p.max_backoff},
        }
        out.append(entry)
    if as_json:
        _print_json(out)
        return
    if not registry:
        raise click.ClickException(
            "no jobs defined: none in the Celery app's task modules (-A APP, or the app attach() hosted the "
            "engine on) nor in MOTIR_IMPORTS (now: " + (",".join(settings.imports) or "unset") + ")")

    def trigger(e: dict[str, Any]) -> str:
        if e["cron"]:
            words = f" — {e['schedule']}" if e["schedule"] else ""
            return f"cron {e['cron']} ({e['timezone']}){words}"
        if not e["events"]:
            return "direct (.delay() / Celery messages)"
        return "event " + ", ".join(e["events"])

    def retry(e: dict[str, Any]) -> str:
        p = e["retry_policy"]
        if p["max_attempts"] == 1:
            return f"{p['name']}: 1 attempt, no retry"
        growth = f" ×{p['factor']:g}" if p["factor"] != 1 else " constant"
        return f"{p['name']}: {p['max_attempts']} attempts, backoff {format_duration(p['backoff'])}{growth}"

    def upcoming(e: dict[str, Any]) -> str:
        if not e["next_slots"]:
            return ""
        return ", ".join(f"{format_ago(datetime.fromisoformat(s), now)} ({datetime.fromisoformat(s):%a %H:%M %Z})"
                         for s in e["next_slots"])

    click.echo(text_table(["job", "task", "trigger", "retry policy", "next slots"],
                      [(e["id"], e["task"], trigger(e), retry(e), upcoming(e)) for e in out], max_width=90))


# --- stats -------------------------------------------------------------------------


@main.command()
@click.argument("job", required=False)
@click.option("--since", default="1d", show_default=True,
              help="Runs finished since: a duration back (30m, 2h, 7d) or an ISO date/time (8 days at most).")
@click.option("--workspace", help="Only this workspace.")
@json_option
def stats(job: str | None, since: str, workspace: str | None, as_json: bool) -> None:
    """Per job: runs, failure rate, p50/p95 duration, retries and DLQ entries, from the stats rollup.

    The rollup is folded from finished runs by the workers' sweep (every MOTIR_SWEEP_INTERVAL),
    so it outlives `motir purge`; its 5-minute buckets are kept 8 days."""
    from motir_celery.ops import insights

    settings = _settings()
    job = _text_option(job, "JOB")
    workspace = _text_option(workspace, "--workspace")
    with _operator_session(settings) as s:
        read = reads.freshness(s)
        try:
            start = parse_since(since, read.now)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--since") from None
        found = insights.job_stats(s, since=start, job=job, workspace=workspace)
    _read_note(read)
    if as_json:
        _print_json({"since": start.isoformat(), "now": read.now.isoformat(), "jobs": [j.as_json() for j in found]})
        return
    if not found:
        click.echo(f"no run finished since {format_instant(start)}{f' for {job}' if job else ''} "
                   "(the sweep folds finished runs every MOTIR_SWEEP_INTERVAL)")
        return

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:.1f}%"

    def ms(x: float | None) -> str:
        return "-" if x is None else format_duration(x / 1000)

    click.echo(f"runs finished since {format_instant(start)} ({format_ago(start, read.now)})")
    click.echo(text_table(["job", "runs", "failed", "failure rate", "p50", "p95", "retried", "DLQ", "DLQ open"],
                          [(j.job_id, j.runs, j.failed, pct(j.failure_rate), ms(j.p50_ms), ms(j.p95_ms), j.retried,
                            j.dlq_entries, j.dlq_open) for j in found]))


def _attempt_label(order: int, attempt: int) -> str:
    """An attempt's place in the ledger, with its number in its budget when a resume reset it."""
    return str(order) if order == attempt else f"{order} ({attempt} after a resume)"


# --- doctor ----------------------------------------------------------------------


@main.command()
@click.option("--timeout", default=3.0, show_default=True, type=click.FloatRange(0.1, 600), callback=_finite,
              help="Seconds to wait for the database, broker and workers.")
@click.option("--max-wait", default="5m", show_default=True,
              help="Fail when the oldest due run has waited longer than this.")
@click.option("--strict", is_flag=True,
              help="Exit 1 on a WARN too (development mode, no admin login, open DLQ entries): for deploy pipelines.")
@click.option("--statements", is_flag=True,
              help="Only list every SQL statement of the engine: name, audience, roles, what it does (no checks).")
@json_option
def doctor(timeout: float, max_wait: str, strict: bool, statements: bool, as_json: bool) -> None:
    """Check the database, migrations, roles and RLS, broker, workers, sweeper, queue and DLQ.

    Exit 1 on any FAIL; with --strict on any WARN too. --statements lists the statements instead."""
    from motir_celery.ops.doctor import exit_status, run_checks

    if statements:
        _statements(as_json)
        return
    try:
        wait = parse_duration(max_wait).total_seconds()
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-wait") from None
    settings = _settings()
    _load_jobs(settings)
    checks = []
    for check in run_checks(settings, timeout=timeout, max_wait=wait, app=_app()):
        checks.append(check)
        if not as_json:  # each line as soon as it is known: a slow broker shows where it hangs
            colour = {"OK": "green", "FAIL": "red", "WARN": "yellow"}[check.status]
            click.echo(f"{click.style(check.status.ljust(4), fg=colour)}  {check.name.ljust(18)}  {check.detail}")
            if check.fix:
                click.echo(f"{'':4}  {'':18}  fix: {check.fix}")
    status = exit_status(checks, strict=strict)
    if as_json:
        _print_json({"ok": status == 0, "strict": strict, "checks": checks})
    if status:
        sys.exit(status)


def _statements(as_json: bool) -> None:
    from motir_celery.store.sql import catalogue

    entries = catalogue()
    if as_json:
        _print_json([{"name": e.name, "audience": e.audience, "roles": list(e.roles), "doc": e.doc,
                      "prepared": e.statement.prepare} for e in entries])
        return
    click.echo(text_table(["statement", "audience", "roles", "what it does"],
                          [(e.name, e.audience, ", ".join(e.roles), e.doc) for e in entries], max_width=120))
    counts: dict[str, int] = {}
    for e in entries:
        counts[e.audience] = counts.get(e.audience, 0) + 1
    click.echo(f"\n{len(entries)} statements: " + ", ".join(f"{a} {n}" for a, n in counts.items()))


# --- purge -----------------------------------------------------------------------


@main.command()
@click.option("--older-than", "older_than", required=True, help="Retention period, e.g. 30d, 12h, 2w.")
@click.option("--batch-size", default=1000, show_default=True, type=click.IntRange(1, 100_000),
              help="Rows per transaction.")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@json_option
def purge(older_than: str, batch_size: int, dry_run: bool, as_json: bool) -> None:
    """Delete finished runs (with steps and attempts), closed DLQ entries and events no run needs.

    Never deletes a queued or running run, nor a DLQ entry that is neither
    replayed nor dismissed (its failed run is kept with it).
    """
    from motir_celery.ops.purge import purge as do_purge

    try:
        age = parse_duration(older_than)
    except ValueError as exc:
        zero = _ZERO.fullmatch(older_than) is not None
        if not (zero and dry_run):
            # 0 with --dry-run counts everything finished; a real purge of it would also take runs
            # that finished a moment ago, whose results a caller may still be reading (.get()).
            hint = " (0 is accepted with --dry-run, to count everything finished)" if zero else ""
            raise click.BadParameter(str(exc) + hint, param_hint="--older-than") from None
        age = timedelta(0)
    _progress(f"{'counting' if dry_run else 'purging'} what finished more than {format_duration(age.total_seconds())} ago"
              f"{'' if dry_run else f', {batch_size} rows per batch'}…")
    def progress(kind: str, n: int) -> None:
        _progress(f"  {kind}: {n} deleted so far")

    report = do_purge(age, batch_size=batch_size, dry_run=dry_run, progress=None if as_json else progress)
    if as_json:
        _print_json(report)
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(text_table(["", verb], [
        ("runs", report.runs), ("steps", report.steps), ("attempts", report.attempts),
        ("closed DLQ entries", report.dlq_entries), ("events", report.events),
    ]))
    if report.kept_for_open_dlq:
        click.echo(f"kept {report.kept_for_open_dlq} failed run(s) whose DLQ entry is still open "
                   "(replay or dismiss them first)")
    for note in report.notes:
        click.echo(f"note: {note}")


# --- quota ------------------------------------------------------------------------

@main.group()
def quota() -> None:
    """Who goes next: the fleet's in-flight limit and each workspace's weight and cap (docs/fair-share.md)."""


def _one_workspace(workspace: str | None, system: bool) -> str | None:
    """WORKSPACE, or None for the system runs (``--system``); exactly one of them."""
    if system == (workspace is not None):
        raise click.UsageError("name one WORKSPACE, or give --system for the system runs")
    return workspace


@quota.command("show")
@click.option("--workspace", default=None, help="One workspace only.")
@click.option("--system", is_flag=True, help="The system runs' quota only.")
@json_option
def quota_show(workspace: str | None, system: bool, as_json: bool) -> None:
    """The fleet's limit and load, and each workspace's quota with its runs in flight and held."""
    import motir_celery
    from motir_celery.core import admission

    every = workspace is None and not system
    fleet, rows = admission.quotas(motir_celery.current_engine(),
                                   None if every else _one_workspace(workspace, system), every=every)
    if as_json:
        _print_json({"fleet": fleet, "workspaces": rows})
        return
    limit = fleet["fleet_limit"]
    state = "off (every run is published at once)" if limit is None else f"on, {limit} in flight at most"
    click.echo(f"admission: {state}; now {fleet['in_flight']} in flight, {fleet['held']} held")
    click.echo(text_table(["workspace", "weight", "max running", "in flight", "held", "updated", "by"], [
        ("(system)" if r["workspace_id"] is None else r["workspace_id"], r["weight"], r["max_running"] or "no cap",
         r["in_flight"], r["held"], format_instant(r["updated_at"]), r["updated_by"]) for r in rows]))


@quota.command("set")
@click.argument("workspace", required=False)
@click.option("--system", is_flag=True, help="The system runs' quota (instead of WORKSPACE).")
@click.option("--weight", type=click.IntRange(1, 1000), default=None, help="Its share while others wait (default 1).")
@click.option("--max-running", type=click.IntRange(1, None), default=None, help="At most this many in flight.")
@click.option("--no-cap", is_flag=True, help="Remove its cap.")
@click.option("--actor", required=True, help="Who changed it (recorded as updated_by).")
def quota_set(workspace: str | None, system: bool, weight: int | None, max_running: int | None, no_cap: bool,
              actor: str) -> None:
    """Set WORKSPACE's weight and/or cap. Live: the dispatcher's next choice uses it."""
    import motir_celery
    from motir_celery.core import admission

    ws = _one_workspace(workspace, system)
    if no_cap and max_running is not None:
        raise click.UsageError("give --max-running or --no-cap, not both")
    if weight is None and max_running is None and not no_cap:
        raise click.UsageError("nothing to set: give --weight, --max-running or --no-cap")
    q = admission.set_quota(motir_celery.current_engine(), ws, weight=weight, max_running=max_running,
                            clear_cap=no_cap, actor=_actor(actor))
    cap = "no cap" if q.max_running is None else f"at most {q.max_running} in flight"
    click.echo(f"{'(system)' if ws is None else ws}: weight {q.weight}, {cap} (by {q.updated_by})")


@quota.command("admission")
@click.option("--in-flight", "in_flight", type=click.IntRange(1, None), default=None,
              help="Turn admission on (or change its limit): at most this many runs in flight, fleet-wide.")
@click.option("--off", is_flag=True, help="Turn admission off: every held run is sent now.")
@click.option("--actor", required=True, help="Who changed it (recorded as updated_by).")
def quota_admission(in_flight: int | None, off: bool, actor: str) -> None:
    """Turn admission on (or change the fleet's in-flight limit), or off."""
    import motir_celery
    from motir_celery.core import admission

    if off == (in_flight is not None):
        raise click.UsageError("give --in-flight N or --off")
    engine = motir_celery.current_engine()
    if off:
        click.echo(f"admission off; {admission.turn_off(engine)} held run(s) sent")
        return
    admission.set_in_flight(engine, in_flight or 1, actor=_actor(actor))
    click.echo(f"admission on: at most {in_flight} run(s) in flight (every process within "
               f"{admission.OFF_RECHECK_SECONDS:g} s; held runs go at the next settle or sweep)")


# --- dashboard -------------------------------------------------------------------


@main.group(invoke_without_command=True)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to bind. Another address needs a proxy in front (docs/security.md): header "
                   "mode refuses it without MOTIR_DASHBOARD_TRUSTED_PROXIES, and development mode always.")
@click.option("--port", default=8089, show_default=True, type=click.IntRange(1, 65535))
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--local", is_flag=True,
              help="Local mode (MOTIR_DASHBOARD_AUTH=local): no sign-in, you are an admin of every workspace; "
                   "loopback only, labelled on every page. For a developer's machine.")
@click.option("--user-header", default="X-Motir-User", show_default=True,
              help="Header mode: the header your proxy puts the user's name in.")
@click.option("--workspace-header", default="X-Motir-Workspace", show_default=True,
              help="Header mode: the header of the user's workspace.")
@click.option("--admin-header", default="X-Motir-Admin", show_default=True,
              help="Header mode: the header that makes the user an admin of every workspace.")
@click.option("--metrics-window", default=300.0, show_default=True, type=click.FloatRange(min=1.0),
              callback=_finite, help="Seconds the *_recent series of /metrics look back.")
@click.option("--metrics-by-workspace", is_flag=True,
              help="A workspace label on the stats rollup's series (bounded by jobs × workspaces).")
@click.option("--flower-url", default=None, help="A link to Flower in the navigation bar (http or https).")
@click.option("--allow-plaintext-passwords", is_flag=True,
              help="Basic mode: accept clear-text passwords in the users file. Development only.")
@click.pass_context
def dashboard(ctx: click.Context, host: str, port: int, log_level: str, local: bool, user_header: str,
              workspace_header: str, admin_header: str, metrics_window: float, metrics_by_workspace: bool,
              flower_url: str | None, allow_plaintext_passwords: bool) -> None:
    """Serve the web dashboard (runs, run timelines, DLQ with Replay, queue health, /metrics).

    Identity and the CSRF secret come from MOTIR_DASHBOARD_AUTH, MOTIR_DASHBOARD_USERS_FILE,
    MOTIR_DASHBOARD_TRUSTED_PROXIES and MOTIR_DASHBOARD_SECRET (docs/settings.md)."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        import uvicorn

        from motir_celery.ops.dashboard import DashboardConfig, create_app
        from motir_celery.ops.dashboard.app import check_bind
    except ImportError as exc:
        raise click.ClickException(f"the dashboard needs its extra: pip install 'motir-celery[dashboard]' ({exc})") from None
    settings = _settings()
    import os

    given = DashboardConfig.from_env({**os.environ, "MOTIR_DASHBOARD_AUTH": "local"} if local else None)
    auth = dataclasses.replace(given.auth, user_header=user_header, workspace_header=workspace_header,
                               admin_header=admin_header, allow_plaintext=allow_plaintext_passwords)
    config = dataclasses.replace(given, auth=auth, metrics_window=metrics_window, flower_url=flower_url,
                                 metrics_by_workspace=metrics_by_workspace)
    check_bind(host, config, settings)  # ConfigurationError: a one-line refusal, before anything listens
    if not settings.app_database_url:
        _progress("development mode: reads drop to motir_app from the engine's login (SET LOCAL ROLE); "
                  "set MOTIR_APP_DATABASE_URL and MOTIR_ADMIN_DATABASE_URL in production (docs/security.md)")
    app = create_app(config, settings=settings)
    if config.auth.mode == "local":
        _progress(f"local mode: no sign-in; anyone who reaches this port on this machine acts as "
                  f"{config.auth.local_user}, an admin of every workspace (development only)")
    _progress(f"dashboard on http://{host}:{port}/ (identity: {config.auth.mode})")
    uvicorn.run(app, host=host, port=port, log_level=log_level, proxy_headers=False, server_header=False)


@dashboard.command("hash-password")
@click.option("--stdin", "from_stdin", is_flag=True, help="Read the password from the first line of stdin.")
@click.option("--scheme", type=click.Choice(["argon2", "scrypt"]),
              help="Default: argon2id when argon2-cffi is installed (the dashboard extra), else scrypt.")
def hash_password_command(from_stdin: bool, scheme: str | None) -> None:
    """Print a password hash for the users file (user:HASH:workspace). Never pass the password as an argument."""
    from motir_celery.ops.dashboard.passwords import hash_password

    if from_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = click.prompt("password", hide_input=True, confirmation_prompt=True, err=True)
    if not password:
        raise click.ClickException("an empty password cannot be hashed")
    try:
        click.echo(hash_password(password, scheme=scheme))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


if __name__ == "__main__":  # pragma: no cover
    main()
