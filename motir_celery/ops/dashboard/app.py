"""The dashboard: runs, a run's timeline and tree, events, the DLQ with Replay and Resume (one or many), health,
insights (ops/insights.py, charts.py), admission and quotas (operators), /metrics.

Starlette with server-rendered Jinja2 templates: no JavaScript, no front-end
build, one stylesheet. Pages refresh themselves (a meta refresh) while a run
is queued or running.

Safety, by default:

* reads go through the **app role** in the caller's workspace context
  (``workspace_session``), so row-level security — not this code — decides what
  a user sees; a run of another workspace is a 404, exactly like one that does
  not exist;
* writes (replay, dismiss, cancel) first read the target through that same
  context, then act through the engine, audited with the caller's name;
* every POST needs a CSRF token bound to the caller, and a same-site ``Origin``;
* every query parameter is checked (length, control characters, range): a bad
  one is a 400 naming it, never a database error; the banner after an action
  shows only texts from ``NOTICES`` / ``ERRORS``, chosen by a code in the URL,
  so a link cannot make the page say anything else;
* the reading logins may be on a hot standby: every page says so (base template,
  from the ``Freshness`` read in the page's own transaction) and how far behind it
  is; after an action the redirect waits, briefly, for the standby to replay the
  primary's write, and says so when it has not (``?stale=1``);
* responses carry a strict Content-Security-Policy (no scripts at all), deny
  framing, and are not cached; pages show no URL, password or setting;
* ``motir dashboard`` binds to 127.0.0.1 unless told otherwise, and refuses
  another address in header mode without trusted proxies, or when the reads
  would drop to the app role from the engine's login (development mode)
  (``check_bind``).

``/metrics`` (Prometheus) and ``/healthz`` need no identity: the metrics carry
job ids and counts, no workspace and no payload.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping
from urllib.parse import urlencode, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from motir_celery.contrib import sse
from motir_celery.core import admission
from motir_celery.core.engine import Engine
from motir_celery.core.operator import bulk as bulk_ops
from motir_celery.core.operator import dlq as dlq_ops
from motir_celery.core.operator import offboard
from motir_celery.core.operator import resume as resume_ops
from motir_celery.core.producer.streams import FINAL
from motir_celery.errors import ConfigurationError, MotirError
from motir_celery.ops import insights, reads
from motir_celery.ops.dashboard import charts
from motir_celery.ops.dashboard.auth import AuthConfig, Authenticator, AuthError, CsrfTokens, Identity, is_loopback
from motir_celery.ops.metrics import build_registry
from motir_celery.ops.timefmt import format_ago, format_duration, format_instant, parse_since
from motir_celery.settings import Settings
from motir_celery.store.db import primary_wal_lsn
from motir_celery.store.models import RUN_STATES

__all__ = ["DashboardConfig", "create_app", "check_bind", "NOTICES", "ERRORS"]

log = logging.getLogger("motir_celery.ops.dashboard")

HERE = Path(__file__).resolve().parent

CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
#: The page of a run that is queued or running: the one page with a script, the dashboard's own
#: (/static/live.js, no inline script), which follows the run's events (``/runs/{id}/live``) and
#: updates the page in place.
CSP_LIVE = CSP + "; script-src 'self'; connect-src 'self'"
#: The live view reads again at most this often (a stream written every millisecond is sent in
#: batches), and at least this often without a notification.
LIVE_EVERY, LIVE_FALLBACK = 0.1, 1.0


@dataclass(frozen=True)
class DashboardConfig:
    auth: AuthConfig = field(default_factory=AuthConfig)
    #: Signs CSRF tokens. Unset: random per process (fine for one replica).
    secret: str | None = None
    #: Window of the *_recent metrics, in seconds.
    metrics_window: float = 300.0
    #: Optional link to Flower in the navigation bar.
    flower_url: str | None = None
    #: A workspace label on the stats rollup's counters (``--metrics-by-workspace``): bounded by
    #: jobs × workspaces, so off unless asked.
    metrics_by_workspace: bool = False

    def __post_init__(self) -> None:
        if self.flower_url and urlsplit(self.flower_url).scheme not in ("http", "https"):
            raise ConfigurationError(f"the Flower URL {self.flower_url!r} must be an http(s) URL")
        if not self.metrics_window > 0:
            raise ConfigurationError(f"the metrics window must be a positive number of seconds, got {self.metrics_window!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "DashboardConfig":
        """Identity and the CSRF secret from the environment (docs/settings.md); the rest are
        ``motir dashboard``'s options, or this class's fields for an app made in code."""
        env = os.environ if env is None else env
        return cls(auth=AuthConfig.from_env(env), secret=env.get("MOTIR_DASHBOARD_SECRET", "").strip() or None)


@dataclass(frozen=True)
class QuotaLine:
    """One workspace's quota row (``workspace`` None: the system runs) and its runs in flight and held."""

    workspace: str | None
    weight: int
    max_running: int | None
    in_flight: int
    held: int
    updated_at: datetime
    updated_by: str | None


@dataclass(frozen=True)
class AdmissionView:
    """The operator's page of admission: the fleet's limit (None: off), its runs in flight and held,
    the quota rows, and what the workspaces without a row (weight 1, no cap) have in flight and held."""

    limit: int | None
    in_flight: int
    held: int
    lines: list[QuotaLine]
    others_in_flight: int
    others_held: int

    @classmethod
    def of(cls, fleet: Mapping[str, Any], rows: list[dict[str, Any]]) -> "AdmissionView":
        """From ``core.admission.quotas``' two reads (each its own statement: a total may lag a row by
        a run, so what the rows leave to the others is never shown below 0)."""
        lines = [QuotaLine(workspace=r["workspace_id"], weight=int(r["weight"]), max_running=r["max_running"],
                           in_flight=int(r["in_flight"]), held=int(r["held"]), updated_at=r["updated_at"],
                           updated_by=r["updated_by"]) for r in rows]
        in_flight, held = int(fleet["in_flight"]), int(fleet["held"])
        return cls(limit=fleet["fleet_limit"], in_flight=in_flight, held=held, lines=lines,
                   others_in_flight=max(0, in_flight - sum(q.in_flight for q in lines)),
                   others_held=max(0, held - sum(q.held for q in lines)))


class _Dashboard:
    def __init__(self, config: DashboardConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.settings = settings = engine.settings
        self.auth = Authenticator(config.auth)
        self.csrf = CsrfTokens(config.secret)
        self.registry = build_registry(window=config.metrics_window, settings=settings,
                                       by_workspace=config.metrics_by_workspace)
        self.sweep_interval = settings.sweep_interval  # how often the rollup is folded
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        env = self.templates.env
        env.filters["instant"] = format_instant
        env.filters["duration"] = format_duration
        env.filters["pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, default=str)
        # as the live script writes a value (JSON.stringify): the page reads the same before and after
        env.filters["compact"] = lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False, default=str)
        env.filters["short"] = lambda v: str(v)[:8] if v else "-"
        env.filters["wal_bytes"] = reads.format_wal_bytes
        env.globals["format_ago"] = format_ago
        env.globals["RUN_STATES"] = RUN_STATES

    # --- plumbing -------------------------------------------------------------

    def has_broker(self) -> bool:
        """Whether runs can be published from here (the engine's Celery app is built on the first
        replay: a dashboard that never replays never needs the broker)."""
        try:
            self.engine.host
        except ConfigurationError:
            return False
        return True

    def session(self, who: Identity) -> Any:
        return self.engine.session(who.workspace, admin=who.admin)

    @staticmethod
    def caller(who: Identity) -> dlq_ops.Caller:
        return dlq_ops.Caller(who.user, who.workspace, who.admin)

    def render(self, request: Request, who: Identity, name: str, status: int = 200, *,
               read: reads.Freshness, **context: Any) -> Response:
        # Banner texts come from fixed tables and templates; an unknown code shows nothing.
        context.update(who=who, csrf=self.csrf.issue(who), flower_url=self.config.flower_url,
                       notice=NOTICES.get(request.query_params.get("notice", "")),
                       error=ERRORS.get(request.query_params.get("error", "")),
                       read=read, stale=request.query_params.get("stale") == "1")
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    def problem(self, request: Request, status: int, message: str, who: Identity | None = None,
                challenge: bool = False, read: reads.Freshness | None = None) -> Response:
        headers = {"WWW-Authenticate": f'Basic realm="{self.config.auth.realm}", charset="UTF-8"'} if challenge else None
        return self.templates.TemplateResponse(
            request, "problem.html",
            {"status": status, "message": message, "who": who, "flower_url": None, "read": read, "stale": False},
            status_code=status, headers=headers,
        )

    def caught_up(self, who: Identity) -> bool:
        """After a write through the engine (the primary): whether the caller's reads show it.

        At once on a primary (one query). On a standby, wait up to ``CATCH_UP_WAIT`` for it
        to replay the primary's WAL position taken after the write; False: it has not, and
        the next page may show the state before the write.
        """
        with self.session(who) as s:
            if not reads.freshness(s).standby:
                return True
        target = primary_wal_lsn(self.settings)
        deadline = time.monotonic() + CATCH_UP_WAIT
        while True:
            with self.session(who) as s:
                if reads.replayed(s, target):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def back(self, who: Identity, path: str, **message: str) -> Response:
        """The redirect after an action that reached the engine; ``stale=1`` if the reads lag it."""
        try:
            caught_up = self.caught_up(who)
        except SQLAlchemyError:  # the write is committed: a reader down now must not make it a 500
            log.warning("after an action by %s: cannot tell whether the reads show it", who.user, exc_info=True)
            caught_up = False
        if not caught_up:
            message["stale"] = "1"
        return _back(path, **message)

    def page(self, handler: Callable[[Request, Identity], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Wrap a handler: identify the caller, and for POSTs check CSRF and Origin."""

        async def endpoint(request: Request) -> Response:
            try:
                who = await self.auth.identify(request)  # basic mode verifies on a pool, off this loop
            except AuthError as exc:
                if exc.status in (429, 503):  # a flood's answer: plain text, no template (a third of the CPU)
                    return PlainTextResponse(f"{exc.status}: {exc.message}\n", status_code=exc.status,
                                             headers={"Retry-After": str(exc.retry_after or 1)})
                response = self.problem(request, exc.status, exc.message, challenge=exc.challenge)
                if exc.retry_after is not None:
                    response.headers["Retry-After"] = str(exc.retry_after)
                return response
            if request.method == "POST":
                form = await request.form()
                token = form.get("csrf")
                if not _same_origin(request) or not self.csrf.verify(token if isinstance(token, str) else None, who):
                    return self.problem(request, 403, "this form is stale or came from another site: "
                                        "reload the page and try again", who)
            try:
                return await handler(request, who)
            except BadParameter as exc:
                return self.problem(request, 400, str(exc), who)
            except ConfigurationError as exc:  # e.g. an admin without MOTIR_ADMIN_DATABASE_URL
                log.error("dashboard misconfigured: %s", exc)
                return self.problem(request, 503, "the dashboard is not configured for this request "
                                    "(see its log)", who)

        return endpoint

    # --- pages ------------------------------------------------------------------

    async def runs(self, request: Request, who: Identity) -> Response:
        q = _params(request, "job", "state", "workspace", "since", "limit")
        filters = {k: q.get(k) or "" for k in ("job", "state", "workspace", "since")}
        limit = _int_param(q.get("limit"), "limit", 1, reads.MAX_LIMIT, default=50)
        if filters["state"] and filters["state"] not in RUN_STATES:
            raise BadParameter("state", f"one of {', '.join(RUN_STATES)}")

        def load() -> tuple[list[reads.RunSummary], reads.Freshness]:
            with self.session(who) as s:
                read = reads.freshness(s)
                now = read.now
                since = None
                if filters["since"]:
                    try:
                        since = parse_since(filters["since"], now)
                    except ValueError as exc:
                        raise BadParameter("since", str(exc)) from None
                # A tenant's listing names its workspace too: the same rows as its policy lets it see,
                # but a predicate the planner reads ix_job_queue_workspace_recent with (the policy's
                # OR with the admin arm is one it cannot: tests/store/test_schema.py).
                rows = reads.list_runs(s, job=filters["job"] or None, state=filters["state"] or None,
                                       workspace=(filters["workspace"] or None) if who.admin else who.workspace,
                                       since=since, limit=limit)
                return rows, read

        rows, read = await run_in_threadpool(load)
        return self.render(request, who, "runs.html", runs=rows, now=read.now, filters=filters,
                           filter_error=None, limit=limit, read=read)

    async def run(self, request: Request, who: Identity) -> Response:
        run_id = request.path_params["run_id"]

        def load() -> tuple[reads.RunDetail | None, reads.RunTree | None, reads.Freshness]:
            with self.session(who) as s:
                detail = reads.get_run(s, run_id)
                # A canvas (or any parent) is shown as its tree, bounded (reads.TREE_LIMIT rows).
                tree = reads.get_tree(s, run_id) if detail is not None and detail.children else None
                flows[run_id] = insights.run_flow(s, detail.run.id) if detail is not None else None
                return detail, tree, reads.freshness(s)

        flows: dict[str, insights.RunFlow | None] = {}  # flow control's say on the run: why it waits
        detail, tree, read = await run_in_threadpool(load)
        if detail is None:
            # A standby behind the primary may not have a run that exists (one just replayed).
            return self.problem(request, 404, f"no run {run_id} in your workspace" + (
                "; or not yet: these pages read a standby that is behind the primary, reload in a moment"
                if not read.caught_up else ""), who, read=read)
        live = detail.run.state in ("queued", "running")
        response = self.render(request, who, "run.html", d=detail, r=detail.run, now=detail.now,
                               timeline=_timeline(detail), tree=tree, tree_depth=reads.TREE_DEPTH,
                               flow=flows.get(run_id), live=live, read=read,
                               live_script=f"/runs/{detail.run.id}/live" if live else None)
        if live:
            response.headers["Content-Security-Policy"] = CSP_LIVE
        return response

    async def live(self, request: Request, who: Identity) -> Response:
        """A run's events for its page (server-sent): ``run`` (state, steps, attempts), ``progress``,
        ``item`` (a stream's item, first the last ``reads.TAIL`` of each), ``end`` once it finished."""
        run_id = _path_id(request, "run_id")

        def visible() -> reads.RunDetail | None:
            with self.session(who) as s:
                return reads.get_run(s, run_id) if run_id is not None else None

        detail = await run_in_threadpool(visible)
        if detail is None or run_id is None:
            return self.problem(request, 404, f"no run {request.path_params['run_id']} in your workspace", who)
        workspace = detail.run.workspace_id
        rid = run_id

        def load(after: dict[str, int]) -> tuple[Any, dict[str, list[tuple[int, Any]]]]:
            with self.session(who) as s:
                row = reads.run_progress_row(s, rid, workspace)
                state, items = reads.live_items(s, rid, workspace, after)
            return row, items

        async def events() -> Any:
            import asyncio

            woken = asyncio.Event()
            loop = asyncio.get_running_loop()
            def wake() -> None:
                loop.call_soon_threadsafe(woken.set)

            listener = await run_in_threadpool(self.engine.listener)
            handle = await run_in_threadpool(listener.follow, rid, wake) if listener is not None else None
            # From the first item the page shows (it shows each position once): a stream's last items.
            after = {st.name: st.tail[0][0] - 1 for st in detail.streams if st.tail}
            sent_run = sent_progress = None
            try:
                yield sse.frame("hello", {"run_id": str(rid)})
                while True:
                    woken.clear()
                    row, items = await run_in_threadpool(load, dict(after))
                    if row is None:
                        return
                    run = {"state": row["run_state"], "steps": row["steps"], "attempts": row["attempts"]}
                    if run != sent_run:
                        yield sse.frame("run", run)
                        sent_run = run
                    progress = ({"state": row["state"], "meta": row["meta"], "attempt": row["attempt"],
                                 "current": row["run_state"] == "running" and row["attempt"] == row["attempts"]}
                                if row["state"] is not None else None)
                    if progress is not None and progress != sent_progress:
                        yield sse.frame("progress", progress)
                        sent_progress = progress
                    for name, found in items.items():
                        for position, value in found:
                            yield sse.frame("item", {"stream": name, "position": position, "value": value},
                                            id=position)
                        after[name] = found[-1][0]
                    if not items and row["run_state"] in FINAL:
                        yield sse.frame("end", run)
                        return
                    await asyncio.sleep(LIVE_EVERY)
                    if items:
                        continue
                    try:
                        await asyncio.wait_for(woken.wait(), LIVE_FALLBACK if handle is not None and handle.listening
                                               else LIVE_EVERY)
                    except asyncio.TimeoutError:
                        pass
            finally:
                if handle is not None:
                    await run_in_threadpool(handle.close)

        return StreamingResponse(events(), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)

    async def dlq(self, request: Request, who: Identity) -> Response:
        q = _params(request, "all", "job")
        if q.get("all") not in (None, "", "0", "1"):
            raise BadParameter("all", "0 or 1")
        include_closed = q.get("all") == "1"
        job = q.get("job") or None

        def load() -> tuple[list[reads.DlqEntry], reads.Freshness]:
            with self.session(who) as s:
                return reads.list_dlq(s, include_closed=include_closed, job=job, limit=200), reads.freshness(s)

        entries, read = await run_in_threadpool(load)
        return self.render(request, who, "dlq.html", entries=entries, now=read.now, include_closed=include_closed,
                           job=job or "", read=read)

    async def events(self, request: Request, who: Identity) -> Response:
        q = _params(request, "name", "workspace", "field", "value", "limit")
        filters = {k: q.get(k) or "" for k in ("name", "workspace", "field", "value")}
        limit = _int_param(q.get("limit"), "limit", 1, reads.MAX_LIMIT, default=50)
        try:
            path = reads.payload_path(filters["field"] or None)
        except reads.FilterError as exc:
            raise BadParameter("field", str(exc).split(": ", 1)[-1]) from None

        def load() -> tuple[list[reads.EventRow], reads.Freshness]:
            with self.session(who) as s:
                rows = reads.list_events(s, name=filters["name"] or None,
                                         workspace=(filters["workspace"] or None) if who.admin else None,
                                         field_path=path, value=filters["value"], limit=limit)
                return rows, reads.freshness(s)

        rows, read = await run_in_threadpool(load)
        return self.render(request, who, "events.html", events=rows, now=read.now, filters=filters, limit=limit,
                           read=read)

    async def insights(self, request: Request, who: Identity) -> Response:
        """Per job over the last hour / day / week: runs, failure rate, p50/p95, retries, DLQ entries, the
        flakiest jobs and what waits on flow control — from the stats rollup, under RLS like every page."""
        q = _params(request, "window", "job", "workspace")
        window = q.get("window") or "1d"
        if window not in insights.WINDOWS:
            raise BadParameter("window", f"one of {', '.join(insights.WINDOWS)}")
        job = q.get("job") or None
        workspace = (q.get("workspace") or None) if who.admin else None

        def load() -> tuple[insights.Insights, reads.Freshness]:
            with self.session(who) as s:
                return insights.insights(s, window, job=job, workspace=workspace), reads.freshness(s)

        found, read = await run_in_threadpool(load)
        focus = next((j for j in found.jobs if j.job_id == job), None) if job else found.totals
        return self.render(request, who, "insights.html", i=found, now=found.now, job=job or "",
                           windows=list(insights.WINDOWS), read=read, focus=focus,
                           chart=charts.runs_chart(found.series, found.since, found.now, found.step),
                           sparks={j.job_id: charts.sparkline(found.series.get(j.job_id, []), found.since,
                                                              found.now, found.step) for j in found.jobs},
                           durations=charts.histogram_chart(focus) if focus is not None else None,
                           flakiest=charts.rate_bars(found.flakiest), sweep_interval=self.sweep_interval)

    async def health(self, request: Request, who: Identity) -> Response:
        def load() -> tuple[reads.QueueHealth, reads.QuotaStatus | None, reads.Freshness]:
            with self.session(who) as s:
                # A workspace's page says where it stands in admission (docs/fair-share.md).
                quota = reads.quota_status(s, who.workspace) if who.workspace is not None else None
                return reads.queue_health(s), quota, reads.freshness(s)

        health, quota, read = await run_in_threadpool(load)
        return self.render(request, who, "health.html", h=health, quota=quota, now=health.now, read=read)

    async def quotas(self, request: Request, who: Identity) -> Response:
        """Admission as the operator sees it (operators only; docs/fair-share.md): the fleet's limit, its
        runs in flight and held, and each workspace's weight, cap, in flight and held — what ``motir quota
        show`` prints, from the same function. ``job_admission`` is the engine role's only, so it is read
        through the engine (the primary), as the operator's actions write."""
        if not who.admin:
            return self.problem(request, 403, "admission and quotas are for operators", who)

        def load() -> tuple[AdmissionView, reads.Freshness]:
            fleet, rows = admission.quotas(self.engine)
            with self.session(who) as s:
                now = reads.freshness(s).now
            # Read on the primary: no standby banner (the numbers are not a standby's).
            return AdmissionView.of(fleet, rows), reads.Freshness(now=now)

        view, read = await run_in_threadpool(load)
        return self.render(request, who, "quotas.html", a=view, now=read.now, read=read)

    # --- actions ----------------------------------------------------------------

    # Authorisation is a read under RLS, in core/operator/dlq.py's *_as functions: an entry or
    # run of another workspace is invisible, so a 404 exactly like a missing one.

    def keyed(self, who: Identity, dlq_id: uuid.UUID) -> bool:
        """Whether the entry (as the caller sees it) is of an idempotency-keyed event."""
        with self.session(who) as s:
            entry = reads.get_dlq(s, dlq_id)
        return entry is not None and entry.idempotency_key is not None

    async def replay(self, request: Request, who: Identity) -> Response:
        dlq_id = _path_id(request, "dlq_id")
        form = await request.form()
        confirm, new_key = form.get("confirm"), form.get("key")
        key = new_key.strip() if isinstance(new_key, str) and new_key.strip() else None
        if key is not None and (len(key) > 255 or not key.isprintable()):
            raise BadParameter("key", "an idempotency key: at most 255 printable characters")

        def act() -> Response:
            if dlq_id is None:
                return self.problem(request, 404, "no such DLQ entry in your workspace", who)
            if not self.has_broker():
                log.error("replay of %s by %s: no broker", dlq_id, who.user)
                return _back("/dlq", error="no-broker")
            if confirm != "1" and self.keyed(who, dlq_id):
                # The page warned (a required checkbox); a POST without it is refused, not guessed.
                return _back("/dlq", error="confirm-key")
            try:
                result = dlq_ops.replay_as(self.engine, self.caller(who), dlq_id, idempotency_key=key)
            except MotirError:  # e.g. the job is not defined in this process
                log.exception("replay of %s by %s failed", dlq_id, who.user)
                return _back("/dlq", error="replay-failed")
            if result.status == "not_found":
                return self.problem(request, 404, f"no DLQ entry {dlq_id} in your workspace", who)
            if result.status == "replayed" and result.run_id is not None:
                return self.back(who, f"/runs/{result.run_id}", notice="replayed")
            if result.status == "already_replayed" and result.run_id is not None:
                return self.back(who, f"/runs/{result.run_id}", notice="already-replayed")
            return self.back(who, "/dlq", error=result.status)

        return await run_in_threadpool(act)

    async def resume(self, request: Request, who: Identity) -> Response:
        dlq_id = _path_id(request, "dlq_id")

        def act() -> Response:
            if dlq_id is None:
                return self.problem(request, 404, "no such DLQ entry in your workspace", who)
            if not self.has_broker():
                log.error("resume of %s by %s: no broker", dlq_id, who.user)
                return _back("/dlq", error="no-broker")
            result = resume_ops.resume_as(self.engine, self.caller(who), dlq_id)
            if result.status == "not_found":
                return self.problem(request, 404, f"no DLQ entry {dlq_id} in your workspace", who)
            if result.status in ("resumed", "already_resumed") and result.run_id is not None:
                return self.back(who, f"/runs/{result.run_id}", notice=result.status.replace("_", "-"))
            return self.back(who, "/dlq", error=f"resume-{result.status}")

        return await run_in_threadpool(act)

    async def dismiss(self, request: Request, who: Identity) -> Response:
        dlq_id = _path_id(request, "dlq_id")

        def act() -> Response:
            status = dlq_ops.dismiss_as(self.engine, self.caller(who), dlq_id) if dlq_id else "not_found"
            if status == "not_found":
                return self.problem(request, 404, f"no DLQ entry {dlq_id or ''} in your workspace", who)
            return self.back(who, "/dlq", **({"notice": "dismissed"} if status == "dismissed" else {"error": "closed"}))

        return await run_in_threadpool(act)

    # --- bulk DLQ actions (core/operator/bulk.py): filter, count, confirm, act --------------------

    def bulk_filter(self, values: Mapping[str, str], who: Identity, now: datetime) -> tuple[bulk_ops.DlqFilter, dict[str, str]]:
        """The filter of a bulk action from its parameters (a bad one is a 400 that names it)."""
        f = {k: values.get(k) or "" for k in ("job", "error", "since", "until", "workspace")}
        if not who.admin:
            f["workspace"] = ""  # row-level security scopes a user to their workspace already
        instants: dict[str, datetime | None] = {}
        for name in ("since", "until"):
            try:
                instants[name] = parse_since(f[name], now) if f[name] else None
            except ValueError as exc:
                raise BadParameter(name, str(exc)) from None
        flt = bulk_ops.DlqFilter(job=f["job"] or None, error=f["error"] or None, since=instants["since"],
                                 until=instants["until"], workspace=f["workspace"] or None)
        return flt, f

    async def bulk_form(self, request: Request, who: Identity) -> Response:
        q = _params(request, "job", "error", "since", "until", "workspace", "action")
        action = q.get("action") or "resume"
        if action not in bulk_ops.ACTIONS:
            raise BadParameter("action", f"one of {', '.join(bulk_ops.ACTIONS)}")

        def load() -> tuple[bulk_ops.BulkResult | None, dict[str, str], reads.Freshness]:
            with self.session(who) as s:
                read = reads.freshness(s)
            flt, f = self.bulk_filter(q, who, read.now)
            if flt.empty:
                return None, f, read
            preview = bulk_ops.bulk_dlq(self.engine, action, flt, caller=self.caller(who), dry_run=True,
                                        limit=BULK_LIMIT, sample=10)
            return preview, f, read

        preview, f, read = await run_in_threadpool(load)
        return self.render(request, who, "dlq_bulk.html", f=f, action=action, actions=bulk_ops.ACTIONS,
                           preview=preview, outcome=None, limit=BULK_LIMIT, rate=BULK_RATE, now=read.now, read=read)

    async def bulk_act(self, request: Request, who: Identity) -> Response:
        form = await request.form()
        values: dict[str, str] = {}
        for name in ("job", "error", "since", "until", "workspace", "action", "expect", "confirm"):
            raw = form.get(name)
            value = raw.strip() if isinstance(raw, str) else ""
            if len(value) > MAX_PARAM or not value.isprintable():
                raise BadParameter(name, f"at most {MAX_PARAM} printable characters")
            values[name] = value
        action = values["action"]
        if action not in bulk_ops.ACTIONS:
            raise BadParameter("action", f"one of {', '.join(bulk_ops.ACTIONS)}")
        expect = _int_param(values["expect"], "expect", 1, BULK_LIMIT, default=0)
        if values["confirm"] != "1" or not expect:
            return self.problem(request, 400, "a bulk action needs its count confirmed: count what matches first, "
                                "then tick the box", who)

        def act() -> Response:
            with self.session(who) as s:
                read = reads.freshness(s)
            flt, f = self.bulk_filter(values, who, read.now)
            if flt.empty:
                raise BadParameter("job", "a bulk action needs at least one filter")
            if action != "dismiss" and not self.has_broker():
                log.error("bulk %s by %s: no broker", action, who.user)
                return _back("/dlq", error="no-broker")
            outcome = bulk_ops.bulk_dlq(self.engine, action, flt, caller=self.caller(who), rate=BULK_RATE,
                                        limit=expect)
            log.info("bulk %s by %s (%s): %s", action, who.user, f, outcome.counts)
            return self.render(request, who, "dlq_bulk.html", f=f, action=action, actions=bulk_ops.ACTIONS,
                               preview=None, outcome=outcome, expected=expect, changed=outcome.matched != expect,
                               limit=BULK_LIMIT, rate=BULK_RATE, now=read.now, read=read)

        return await run_in_threadpool(act)

    async def cancel(self, request: Request, who: Identity) -> Response:
        run_id = _path_id(request, "run_id")

        def act() -> Response:
            # A parent waiting for it is sent at once (no broker here: by the sweeper).
            status = dlq_ops.cancel_as(self.engine, self.caller(who), run_id) if run_id else "not_found"
            if status == "not_found":
                return self.problem(request, 404, f"no run {run_id or ''} in your workspace", who)
            return self.back(who, f"/runs/{run_id}", **({"notice": "cancelled"} if status == "cancelled"
                                                         else {"error": "finished"}))

        return await run_in_threadpool(act)

    async def cancel_workspace(self, request: Request, who: Identity) -> Response:
        """Offboarding (operators only): every queued and running run of a workspace cancelled in one
        statement, the signed-in operator and the reason recorded on each (core/operator/offboard.py)."""
        if not who.admin:
            return self.problem(request, 403, "cancelling a workspace's work is for operators", who)
        form = await request.form()
        values = {name: (raw.strip() if isinstance(raw := form.get(name), str) else "")
                  for name in ("workspace", "reason", "confirm")}
        if not values["workspace"]:
            raise BadParameter("workspace", "the workspace whose work to cancel")
        if values["confirm"] != "1":
            return self.problem(request, 400, "cancelling a workspace's work needs the box ticked", who)

        def act() -> Response:
            try:
                offboard.cancel_workspace(self.engine, values["workspace"], actor=who.user, reason=values["reason"])
            except ValueError as exc:
                raise BadParameter("reason", str(exc)) from None
            return self.back(who, "/runs", workspace=values["workspace"], notice="workspace-cancelled")

        return await run_in_threadpool(act)

    # --- unauthenticated ------------------------------------------------------

    async def metrics(self, request: Request) -> Response:
        body = await run_in_threadpool(generate_latest, self.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    async def stylesheet(self, request: Request) -> Response:
        return FileResponse(HERE / "static" / "style.css", media_type="text/css",
                            headers={"Cache-Control": "max-age=300"})

    async def script(self, request: Request) -> Response:
        return FileResponse(HERE / "static" / "live.js", media_type="text/javascript",
                            headers={"Cache-Control": "max-age=300"})

    async def index(self, request: Request) -> Response:
        return RedirectResponse("/runs", status_code=303)


#: The banner after an action: a code in the redirect's query string picks one of these.
NOTICES = {
    "replayed": "replayed: this is the new run",
    "already-replayed": "already replayed: this is the run it made",
    "dismissed": "dismissed: the entry is closed",
    "cancelled": "cancelled (a running run stops at its next step boundary)",
    "workspace-cancelled": "every queued and running run of the workspace is cancelled, with your name and the "
                           "reason on each (running runs stop at their next step boundary)",
    "resumed": "resumed: this run is queued again from its failed step (its stored steps are kept)",
    "already-resumed": "already resumed: this is the run",
}
ERRORS = {
    "dismissed": "this entry was dismissed; it cannot be replayed",
    "deduplicated": "the event's idempotency key was already used, so nothing ran; "
                    "replay it from the CLI with a new key (motir dlq replay ID --key NEW)",
    "closed": "already replayed or dismissed",
    "finished": "the run had already finished",
    "no-broker": "cannot replay: the dashboard has no broker configured (CELERY_BROKER_URL)",
    "replay-failed": "cannot replay: see the dashboard's log (is the job defined in MOTIR_IMPORTS?)",
    "resumed": "this entry was resumed; it cannot be replayed",
    "confirm-key": "this event has an idempotency key: tick the box to confirm the replay",
    "resume-replayed": "this entry was replayed; it cannot be resumed",
    "resume-dismissed": "this entry was dismissed; it cannot be resumed",
    "resume-purged": "the failed run was purged; replay the entry instead",
}

#: A bulk action from the dashboard acts on at most this many entries per request, this many a
#: second (the CLI's ``motir dlq … --limit/--rate`` take more, more slowly): one request stays
#: under ten seconds.
BULK_LIMIT = 500
BULK_RATE = 50.0

#: How long the redirect after an action waits for a standby to replay the primary's write.
CATCH_UP_WAIT = 2.0

#: Longest query parameter value accepted.
MAX_PARAM = 200


class BadParameter(Exception):
    """A query parameter no page can use: a 400 that names it."""

    def __init__(self, name: str, expected: str) -> None:
        super().__init__(f"bad parameter {name!r}: {expected}")


def _params(request: Request, *names: str) -> dict[str, str]:
    """The named query parameters, stripped; a repeated, over-long or control-character one is refused."""
    out: dict[str, str] = {}
    for name in names:
        values = request.query_params.getlist(name)
        if len(values) > 1:
            raise BadParameter(name, "given more than once")
        if not values:
            continue
        value = values[0].strip()
        if len(value) > MAX_PARAM:
            raise BadParameter(name, f"longer than {MAX_PARAM} characters")
        if not value.isprintable():
            raise BadParameter(name, "contains a control character")
        out[name] = value
    return out


def _int_param(raw: str | None, name: str, low: int, high: int, *, default: int) -> int:
    if not raw:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise BadParameter(name, f"a whole number from {low} to {high}")
    return int(raw)


def _path_id(request: Request, name: str) -> uuid.UUID | None:
    return reads.as_uuid(request.path_params[name])


def check_bind(host: str, config: DashboardConfig, settings: Settings) -> None:
    """Refuse to serve on a non-loopback address when the identity or the reads are not safe there.

    * header mode believes identity headers from its trusted proxies only; with none
      configured that means loopback, so another address must name the proxy
      (MOTIR_DASHBOARD_TRUSTED_PROXIES);
    * without MOTIR_APP_DATABASE_URL, reads drop to the app role from the engine's
      login (development mode): a session could RESET ROLE, so not on a network.
    """
    if config.auth.mode == "local" and not is_loopback(host):
        raise ConfigurationError(
            f"refusing to bind {host} in local mode: there is no sign-in and every caller is an admin of "
            "every workspace, so it serves this machine only — bind 127.0.0.1, or use header/basic mode")
    if is_loopback(host):
        return
    if config.auth.mode == "header" and not config.auth.trusted_proxies:
        raise ConfigurationError(
            f"refusing to bind {host} in header identity mode without MOTIR_DASHBOARD_TRUSTED_PROXIES: anyone who "
            "reaches this port could claim to be anyone. Name your proxy's addresses (IPs or CIDRs), use "
            "MOTIR_DASHBOARD_AUTH=basic, or bind 127.0.0.1")
    if not settings.app_database_url:
        raise ConfigurationError(
            f"refusing to bind {host} in development mode (no MOTIR_APP_DATABASE_URL: reads drop to the app role "
            "from the engine's login, which can RESET ROLE): set MOTIR_APP_DATABASE_URL to a login of motir_app "
            "(and MOTIR_ADMIN_DATABASE_URL for admins), or bind 127.0.0.1")


def _back(path: str, **message: str) -> Response:
    return RedirectResponse(path + ("?" + urlencode(message) if message else ""), status_code=303)


def _same_origin(request: Request) -> bool:
    """Refuse a POST another site made the browser send (belt to the CSRF token's braces)."""
    if request.headers.get("sec-fetch-site", "") == "cross-site":
        return False
    origin = request.headers.get("origin")
    if not origin or origin == "null":
        return origin is None  # absent: a non-browser client; "null": a sandboxed or privacy-stripped one
    host = request.headers.get("host", "")
    return urlsplit(origin).netloc == host


def _timeline(d: reads.RunDetail) -> dict[str, Any]:
    """Bars for the run page's SVG: attempts and steps on one time axis (percent units)."""
    start = d.run.created_at
    ends = [d.run.finished_at or d.now]
    ends += [s.completed_at for s in d.steps] + [a.finished_at or d.now for a in d.attempts]
    span = max((max(ends) - start).total_seconds(), 0.001)

    def bar(t0: datetime, t1: datetime) -> tuple[float, float]:
        x = max((t0 - start).total_seconds(), 0.0) / span * 100
        w = max((t1 - t0).total_seconds() / span * 100, 0.4)
        return round(min(x, 99.6), 2), round(min(w, 100 - min(x, 99.6)), 2)

    rows = []
    for a in d.attempts:
        x, w = bar(a.started_at, a.finished_at or d.now)
        rows.append({"kind": "attempt", "label": f"attempt {a.attempt}", "state": a.outcome, "x": x, "w": w,
                     "duration": format_duration(((a.finished_at or d.now) - a.started_at).total_seconds())})
    for s in d.steps:
        x, w = bar(s.started_at, s.completed_at)
        rows.append({"kind": "step", "label": s.step_id, "state": "step", "x": x, "w": w,
                     "duration": format_duration(s.duration)})
    return {"rows": rows, "span": format_duration(span), "height": 26 * len(rows) + 4}


def create_app(
    config: DashboardConfig | None = None,
    *,
    settings: Settings | None = None,
    engine: Engine | None = None,
) -> Starlette:
    """The ASGI app, acting through ``engine`` (default: one with ``settings``, else the current
    engine): replayed runs go to its broker — its Celery app, built on the first replay — and
    every read and write to its database (a replay, through a broker error, is committed and the
    sweeper publishes it)."""
    config = config or DashboardConfig.from_env()
    if engine is None:
        from motir_celery.adapter.celery_app import default_engine
        from motir_celery.core.current import current

        engine = default_engine(settings) if settings is not None else current()
    settings = engine.settings
    # Replay needs the failed job's definition in this process, as a worker does.
    import importlib

    for module in settings.imports:
        importlib.import_module(module)
    d = _Dashboard(config, engine)
    routes = [
        Route("/", d.index),
        Route("/runs", d.page(d.runs)),
        Route("/runs/{run_id}", d.page(d.run)),
        Route("/runs/{run_id}/cancel", d.page(d.cancel), methods=["POST"]),
        Route("/workspaces/cancel", d.page(d.cancel_workspace), methods=["POST"]),
        Route("/runs/{run_id}/live", d.page(d.live)),
        Route("/dlq", d.page(d.dlq)),
        Route("/dlq/bulk", d.page(d.bulk_form), methods=["GET"]),
        Route("/dlq/bulk", d.page(d.bulk_act), methods=["POST"]),
        Route("/dlq/{dlq_id}/replay", d.page(d.replay), methods=["POST"]),
        Route("/dlq/{dlq_id}/dismiss", d.page(d.dismiss), methods=["POST"]),
        Route("/dlq/{dlq_id}/resume", d.page(d.resume), methods=["POST"]),
        Route("/events", d.page(d.events)),
        Route("/health", d.page(d.health)),
        Route("/insights", d.page(d.insights)),
        Route("/quotas", d.page(d.quotas)),
        Route("/metrics", d.metrics),
        Route("/healthz", d.healthz),
        Route("/static/style.css", d.stylesheet),
        Route("/static/live.js", d.script),
    ]
    return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders)])


class SecurityHeaders:
    """Pure ASGI middleware: the same headers on every response, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cacheable = scope.get("path") in ("/static/style.css", "/static/live.js")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.setdefault("Content-Security-Policy", CSP)
                headers.setdefault("X-Frame-Options", "DENY")
                headers.setdefault("X-Content-Type-Options", "nosniff")
                headers.setdefault("Referrer-Policy", "same-origin")
                if not cacheable:
                    headers.setdefault("Cache-Control", "no-store")
            await send(message)

        await self.app(scope, receive, send_with_headers)
