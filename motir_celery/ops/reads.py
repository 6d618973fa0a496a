"""Operator reads: runs, one run in full, the DLQ, queue health.

Every function takes a ``Session`` opened by ``db.workspace_session`` — the app
role, with row-level security enforced — so what a caller can see is decided
by Postgres from the workspace context, never by a ``WHERE`` this module might
forget. The filters here (job, state, workspace) only narrow what RLS already
allows; an admin context (``admin=True``) is what widens it. The statements are
``store/sql/reads.py``'s; this module turns their rows into the values below.

Filters are checked before they reach SQL (``check_filter``): a NUL, a
non-printable character or an over-long value is a ``FilterError`` naming the
filter (a 400 in the dashboard, a one-line error in the CLI), not a database
error.

Each result carries ``now``, the database's clock at read time, so "3 min ago"
and "waiting 40s" are measured on the same clock the engine decides with.

The session may be on a hot standby (``MOTIR_APP_DATABASE_URL`` /
``MOTIR_ADMIN_DATABASE_URL`` may name one): everything here is a plain SELECT, and
``freshness`` says, in the same transaction, whether the rows come from a standby and
how far it is behind (docs/operations.md, "Reads from a standby").
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from motir_celery.core.producer.canvas import outline as canvas_outline
from motir_celery.core.shapes import CANVAS_JOB_ID
from motir_celery.store.models import RUN_STATES
from motir_celery.store.sql import producer
from motir_celery.store.sql import reads as sql

__all__ = [
    "QuotaStatus",
    "quota_status",
    "RunSummary",
    "StepRow",
    "AttemptRow",
    "DlqEntry",
    "RunDetail",
    "ProgressRow",
    "StreamRow",
    "run_output",
    "live_items",
    "run_progress_row",
    "ChildRow",
    "EventRow",
    "QueueHealth",
    "Freshness",
    "db_now",
    "freshness",
    "replayed",
    "format_wal_bytes",
    "list_runs",
    "get_run",
    "list_dlq",
    "get_dlq",
    "list_events",
    "payload_path",
    "queue_health",
    "as_uuid",
    "FilterError",
    "check_filter",
]

MAX_LIMIT = 500
#: Longest filter value (job ids and workspace ids are at most 200 characters).
MAX_FILTER_LENGTH = 200


class FilterError(ValueError):
    """A filter value that cannot name anything; ``param`` says which."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def check_filter(param: str, value: str | None) -> str | None:
    """``value`` stripped (``None`` when empty), or ``FilterError`` for what no id can be."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise FilterError(param, f"must be text, got {type(value).__name__}")
    value = value.strip()
    if len(value) > MAX_FILTER_LENGTH:
        raise FilterError(param, f"longer than {MAX_FILTER_LENGTH} characters")
    if not value.isprintable():
        raise FilterError(param, "contains a control character (a NUL, a newline, …)")
    return value or None


def as_uuid(value: object) -> uuid.UUID | None:
    """A run or DLQ id from a URL or the command line; ``None`` when it is not one."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value).strip())
    except ValueError:
        return None


@dataclass(frozen=True)
class RunSummary:
    id: uuid.UUID
    job_id: str
    event_name: str
    workspace_id: str | None
    state: str
    attempts: int
    max_attempts: int
    retry_policy: str
    created_at: datetime
    run_at: datetime
    finished_at: datetime | None
    claimed_by: str | None
    #: An unreplayed, undismissed DLQ entry exists for this run.
    in_dlq: bool

    @property
    def duration(self) -> float | None:
        return (self.finished_at - self.created_at).total_seconds() if self.finished_at else None


@dataclass(frozen=True)
class StepRow:
    step_id: str
    attempt: int
    started_at: datetime
    completed_at: datetime
    output: Any

    @property
    def duration(self) -> float:
        return (self.completed_at - self.started_at).total_seconds()


@dataclass(frozen=True)
class AttemptRow:
    attempt: int
    worker: str
    outcome: str
    started_at: datetime
    finished_at: datetime | None
    error: Any

    @property
    def duration(self) -> float | None:
        return (self.finished_at - self.started_at).total_seconds() if self.finished_at else None


@dataclass(frozen=True)
class DlqEntry:
    id: uuid.UUID
    run_id: uuid.UUID | None
    workspace_id: str | None
    function_id: str
    event_name: str
    event_data: Any
    failure: Any
    attempts: int
    first_failed_at: datetime
    last_failed_at: datetime
    replayed_at: datetime | None
    replayed_by: str | None
    replay_run_id: uuid.UUID | None
    dismissed_at: datetime | None
    dismissed_by: str | None
    resumed_at: datetime | None = None
    resumed_by: str | None = None
    resumed_run_id: uuid.UUID | None = None
    idempotency_key: str | None = None

    @property
    def open(self) -> bool:
        return self.replayed_at is None and self.dismissed_at is None and self.resumed_at is None

    @property
    def status(self) -> str:
        if self.replayed_at is not None:
            return "replayed"
        if self.dismissed_at is not None:
            return "dismissed"
        if self.resumed_at is not None:
            return "resumed"
        return "open"

    @property
    def error_message(self) -> str:
        failure = self.failure if isinstance(self.failure, dict) else {}
        kind = str(failure.get("type", "")).rsplit(".", 1)[-1]
        message = str(failure.get("message", ""))
        return f"{kind}: {message}" if kind else message


@dataclass(frozen=True)
class ProgressRow:
    """A run's latest progress report (``step.progress``, ``update_state``)."""

    state: str
    meta: Any
    attempt: int
    updated_at: datetime
    #: Reported by the attempt that runs now (what ``AsyncResult(id).state`` shows).
    current: bool


@dataclass(frozen=True)
class StreamRow:
    """One stream of a run: how many items it holds, its last position, and its last items
    (position, value)."""

    name: str
    items: int
    last: int
    tail: list[tuple[int, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class RunDetail:
    run: RunSummary
    now: datetime
    event_id: uuid.UUID | None
    event_data: Any
    idempotency_key: str | None
    scheduled_for: datetime | None
    lease_expires_at: datetime | None
    result: Any
    steps: list[StepRow] = field(default_factory=list)
    attempts: list[AttemptRow] = field(default_factory=list)
    #: This run's own DLQ entry (at most one).
    dlq: DlqEntry | None = None
    #: The DLQ entry this run is the replay of, if any.
    replay_of: DlqEntry | None = None
    #: The run whose step.invoke / step.gather started this one (None: top level).
    parent: ChildRow | None = None
    #: The runs this one started (step.invoke / step.gather), in step order.
    children: list[ChildRow] = field(default_factory=list)
    #: DLQ entries closed by resuming this run (core/resume.py), newest first.
    resumes: list[DlqEntry] = field(default_factory=list)
    #: Its latest progress report, and its streams (core/worker/streams.py).
    progress: ProgressRow | None = None
    streams: list[StreamRow] = field(default_factory=list)
    #: What ran the job, as its body named it (``step.audit``; written when it succeeded).
    provider_key: str | None = None
    model_version: str | None = None


@dataclass(frozen=True)
class ChildRow:
    """A run linked to another by step.invoke / step.gather: its id, job, state and step."""

    run_id: uuid.UUID
    job_id: str
    state: str
    step_id: str | None


@dataclass(frozen=True)
class EventRow:
    """One event and the runs it made (the events page)."""

    id: uuid.UUID
    name: str
    workspace_id: str | None
    idempotency_key: str | None
    received_at: datetime
    data: Any
    runs: list[ChildRow] = field(default_factory=list)


@dataclass(frozen=True)
class QuotaStatus:
    """A workspace's quota and load as its own session sees them (docs/fair-share.md): its weight
    (None: no row, weight 1), its cap (None: none), its runs in flight and running, and those held
    for their turn."""

    weight: int | None
    max_running: int | None
    in_flight: int
    running: int
    held: int


@dataclass(frozen=True)
class QueueHealth:
    now: datetime
    #: (job_id, state) → number of runs.
    depth: dict[tuple[str, str], int]
    #: job_id → seconds the oldest due queued run has waited past its run_at.
    oldest_due: dict[str, float]
    #: Running runs whose lease has expired (the sweeper has not reclaimed them yet).
    expired_leases: int
    dlq_open: int

    def count(self, state: str) -> int:
        return sum(n for (_, s), n in self.depth.items() if s == state)

    @property
    def jobs(self) -> list[str]:
        return sorted({job for job, _ in self.depth})

    @property
    def oldest_due_seconds(self) -> float | None:
        return max(self.oldest_due.values()) if self.oldest_due else None


@dataclass(frozen=True)
class Freshness:
    """Where a read transaction's rows come from: the primary, or a standby and how far behind.

    A standby knows what it has *received* and what it has *replayed*, not what the primary
    has written since: ``behind_bytes`` is received-but-not-replayed WAL, and a standby that
    is not streaming (no WAL receiver: the primary is unreachable, or it restores from an
    archive) cannot say how far behind it is at all.
    """

    #: The reading server's clock (``now()``), as ``db_now``.
    now: datetime
    #: The server is in recovery: a hot standby.
    standby: bool = False
    #: A WAL receiver is connected to the primary (standby only).
    streaming: bool = False
    #: WAL received but not replayed yet, in bytes; None: not known (nothing received yet).
    behind_bytes: int | None = None
    #: Seconds since the newest change the standby has replayed was committed on the primary;
    #: only when it is not caught up (on an idle primary this age grows with nothing missing).
    replay_age: float | None = None

    @property
    def caught_up(self) -> bool:
        """A primary, or a streaming standby that has replayed all it has received."""
        return not self.standby or (self.streaming and self.behind_bytes == 0)


def freshness(session: Session) -> Freshness:
    """``now()`` and, on a hot standby, how far behind it is: one query, in the caller's transaction.

    On a primary the recovery functions return NULL and ``pg_stat_wal_receiver`` is empty,
    so this costs what ``db_now`` costs. Every function it calls is executable by any role:
    reading it needs no grant.
    """
    row = sql.freshness(session.connection())
    if not row["standby"]:
        return Freshness(now=row["now"])
    behind = int(row["behind"]) if row["behind"] is not None else None
    fresh = Freshness(now=row["now"], standby=True, streaming=row["streaming"], behind_bytes=behind)
    if fresh.caught_up or row["age"] is None:
        return fresh
    return dataclasses.replace(fresh, replay_age=float(row["age"]))


def format_wal_bytes(n: int | None) -> str:
    """An amount of WAL for the standby banner: 0 B, 812 B, 16.0 kB, 3.2 MB, 1.1 GB."""
    if n is None:
        return "an unknown amount"
    value, unit = float(n), "B"
    for bigger in ("kB", "MB", "GB", "TB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def replayed(session: Session, lsn: str) -> bool:
    """Whether this server shows the primary's writes up to WAL position ``lsn`` (always, on a primary)."""
    return sql.replayed(session.connection(), lsn)


def db_now(session: Session) -> datetime:
    return producer.db_now(session.connection())


def _summary(row: dict[str, Any]) -> RunSummary:
    return RunSummary(**{k: row[k] for k in RunSummary.__dataclass_fields__})


def list_runs(
    session: Session,
    *,
    job: str | None = None,
    state: str | None = None,
    workspace: str | None = None,
    since: datetime | None = None,
    limit: int = 50,
) -> list[RunSummary]:
    """Newest runs first. ``workspace`` narrows an admin's view; RLS bounds everyone's."""
    if state is not None and state not in RUN_STATES:
        raise FilterError("state", f"unknown state {state!r:.40}; one of {', '.join(RUN_STATES)}")
    job, workspace = check_filter("job", job), check_filter("workspace", workspace)
    found = sql.list_runs(session.connection(), job=job, state=state or None, workspace=workspace, since=since,
                          limit=max(1, min(limit, MAX_LIMIT)))
    return [_summary(r) for r in found]


def _dlq(row: dict[str, Any]) -> DlqEntry:
    return DlqEntry(**{k: row[k] for k in DlqEntry.__dataclass_fields__})


def get_run(session: Session, run_id: uuid.UUID | str) -> RunDetail | None:
    """One run with its event, steps, attempts and DLQ links; ``None`` if absent *or not visible*."""
    rid = as_uuid(run_id)
    if rid is None:
        return None
    conn = session.connection()
    row = sql.run(conn, rid)
    if row is None:
        return None
    steps = [StepRow(r["step_id"], r["attempt"], r["started_at"], r["completed_at"], r["output"])
             for r in sql.run_steps(conn, rid)]
    attempts = [AttemptRow(r["attempt"], r["worker"], r["outcome"], r["started_at"], r["finished_at"], r["error"])
                for r in sql.run_attempts(conn, rid)]
    dlq_rows = sql.run_dlq(conn, rid)
    own = next((_dlq(r) for r in dlq_rows if r["run_id"] == rid), None)
    replay_of = next((_dlq(r) for r in dlq_rows if r["replay_run_id"] == rid), None)
    # Composition: the parent, the children, the resumes. RLS applies to each row.
    family = sql.run_family(conn, rid)
    parent = next((ChildRow(r["id"], r["job_id"], r["state"], None) for r in family if r["is_parent"]), None)
    children = sorted((ChildRow(r["id"], r["job_id"], r["state"], r["parent_step_id"])
                       for r in family if not r["is_parent"]),
                      key=lambda c: _step_order(c.step_id))
    resumes = [_dlq(r) for r in sql.run_resumes(conn, rid)]
    progress, streams = run_output(session, rid, row["workspace_id"])
    return RunDetail(
        run=_summary(row), now=row["now"], event_id=row["event_id"],
        event_data=row["event_data"] if row["event_id"] else {"scheduled_for": row["scheduled_for"]},
        idempotency_key=row["idempotency_key"], scheduled_for=row["scheduled_for"],
        lease_expires_at=row["lease_expires_at"], result=row["result"],
        steps=steps, attempts=attempts, dlq=own, replay_of=replay_of,
        parent=parent, children=children, resumes=resumes, progress=progress, streams=streams,
        provider_key=row["provider_key"], model_version=row["model_version"],
    )


#: How many of a stream's last items a run's page and ``motir runs show`` show.
TAIL = 20


def run_output(session: Session, run_id: uuid.UUID, workspace_id: str | None,
               tail: int = TAIL) -> tuple[ProgressRow | None, list[StreamRow]]:
    """A run's progress report and its streams with their last ``tail`` items (RLS applies)."""
    conn = session.connection()
    row = sql.run_progress(conn, run_id, workspace_id)
    progress = None
    if row is not None and row["state"] is not None:
        progress = ProgressRow(row["state"], row["meta"], row["attempt"], row["updated_at"],
                               row["run_state"] == "running" and row["attempt"] == row["attempts"])
    streams = []
    for s in sql.stream_counts(conn, run_id):
        _, items = sql.stream_items(conn, run_id, workspace_id, s["stream"], after=-1,
                                    offset=max(int(s["items"]) - tail, 0), limit=tail)
        streams.append(StreamRow(s["stream"], int(s["items"]), int(s["last"]),
                                 [(i["position"], i["item"]) for i in items]))
    return progress, streams


def run_progress_row(session: Session, run_id: uuid.UUID, workspace_id: str | None) -> dict[str, Any] | None:
    """The run's state, steps stored, attempts and latest progress report, as one row (the live view)."""
    return sql.run_progress(session.connection(), run_id, workspace_id)


def live_items(session: Session, run_id: uuid.UUID, workspace_id: str | None, after: dict[str, int],
               limit: int = 200) -> tuple[str | None, dict[str, list[tuple[int, Any]]]]:
    """The run's state and, per stream, its items past ``after[stream]`` (-1 for a stream not in it),
    at most ``limit`` each: what the run page's live view has not shown yet (the dashboard's SSE)."""
    conn = session.connection()
    row = sql.run_progress(conn, run_id, workspace_id)
    if row is None:
        return None, {}
    found: dict[str, list[tuple[int, Any]]] = {}
    for name in row["streams"]:
        _, items = sql.stream_items(conn, run_id, workspace_id, name, after=after.get(name, -1), offset=0,
                                    limit=limit)
        if items:
            found[name] = [(i["position"], i["item"]) for i in items]
    return row["run_state"], found


def _step_order(step_id: str | None) -> tuple[str, int]:
    """``kids[10]`` after ``kids[9]``: a gather's children in call order."""
    if step_id and step_id.endswith("]") and "[" in step_id:
        head, _, index = step_id[:-1].rpartition("[")
        if index.isdigit():
            return head, int(index)
    return step_id or "", -1


@dataclass(frozen=True)
class TreeNode:
    """One run under another in a run's tree (a canvas's members, a gather's children, theirs)."""

    run_id: uuid.UUID
    parent_id: uuid.UUID
    step_id: str | None
    job_id: str
    state: str
    #: 1 for the run's own children.
    depth: int
    #: The start of its result's JSON (at most 120 characters), if it succeeded.
    result: str | None


@dataclass(frozen=True)
class RunTree:
    """A run's descendants, depth first in step order, at most ``limit`` of them and ``depth`` deep."""

    run_id: uuid.UUID
    job_id: str
    state: str
    nodes: list[TreeNode]
    #: The run's own children by state (all of them, not only those shown).
    counts: dict[str, int]
    #: Some descendants were left out (past the limit or the depth).
    truncated: bool
    #: A canvas's shape in one line (``chord([50 x canvas.add], canvas.tsum)``); None for another run.
    outline: str | None = None

    @property
    def children(self) -> int:
        return sum(self.counts.values())


#: How many descendants a tree shows at most, and how deep (deeper ones are not read).
TREE_LIMIT = 500
TREE_DEPTH = 8


def get_tree(session: Session, run_id: uuid.UUID | str, *, depth: int = TREE_DEPTH,
             limit: int = TREE_LIMIT) -> RunTree | None:
    """The run's tree (``None`` if absent or not visible; RLS applies to every row)."""
    rid = as_uuid(run_id)
    if rid is None:
        return None
    conn = session.connection()
    row = sql.run(conn, rid)
    if row is None:
        return None
    found = sql.run_tree(conn, rid, depth=max(1, min(depth, 32)), limit=max(1, min(limit, MAX_LIMIT)) + 1)
    truncated = len(found) > limit
    below: dict[uuid.UUID, list[dict[str, Any]]] = {}
    for r in found[:limit]:
        below.setdefault(r["parent_run_id"], []).append(r)
    nodes: list[TreeNode] = []

    def walk(parent: uuid.UUID) -> None:
        for r in sorted(below.get(parent, []), key=lambda r: _step_order(r["step_id"])):
            nodes.append(TreeNode(r["id"], parent, r["step_id"], r["job_id"], r["state"], r["depth"], r["result"]))
            walk(r["id"])

    walk(rid)
    outline = None
    if row["job_id"] == CANVAS_JOB_ID and isinstance(row["event_data"], dict):
        args = row["event_data"].get("args") or []
        outline = canvas_outline(args[0]) if args else None
    return RunTree(rid, row["job_id"], row["state"], nodes, sql.child_states(conn, rid), truncated, outline)


#: The payload path the events page searches: dotted names, e.g. ``order.id``.
def payload_path(value: str | None) -> list[str] | None:
    value = check_filter("field", value)
    if not value:
        return None
    parts = value.split(".")
    if len(parts) > 8 or not all(p and len(p) <= 64 for p in parts):
        raise FilterError("field", "a payload field: dotted names, at most 8 of 64 characters (e.g. order.id)")
    return parts


def list_events(
    session: Session,
    *,
    name: str | None = None,
    workspace: str | None = None,
    field_path: list[str] | None = None,
    value: str | None = None,
    limit: int = 50,
) -> list[EventRow]:
    """Newest events first, each with the runs it made; ``field_path`` / ``value`` match a
    payload field by its text (``data #>> path = value``). RLS bounds what is seen."""
    name, workspace, value = check_filter("name", name), check_filter("workspace", workspace), \
        check_filter("value", value)
    conn = session.connection()
    found = sql.list_events(conn, name=name, workspace=workspace, path=field_path or None, value=value or "",
                            limit=max(1, min(limit, MAX_LIMIT)))
    runs: dict[uuid.UUID, list[ChildRow]] = {}
    if found:
        for r in sql.event_runs(conn, [e["id"] for e in found]):
            runs.setdefault(r["event_id"], []).append(ChildRow(r["id"], r["job_id"], r["state"], None))
    return [EventRow(e["id"], e["name"], e["workspace_id"], e["idempotency_key"], e["received_at"], e["data"],
                     runs.get(e["id"], []))
            for e in found]


def list_dlq(
    session: Session,
    *,
    include_closed: bool = False,
    job: str | None = None,
    workspace: str | None = None,
    limit: int = 50,
) -> list[DlqEntry]:
    """Newest failures first; only open entries (neither replayed nor dismissed) by default."""
    job, workspace = check_filter("job", job), check_filter("workspace", workspace)
    found = sql.list_dlq(session.connection(), include_closed=include_closed, job=job, workspace=workspace,
                         limit=max(1, min(limit, MAX_LIMIT)))
    return [_dlq(r) for r in found]


def get_dlq(session: Session, dlq_id: uuid.UUID | str) -> DlqEntry | None:
    did = as_uuid(dlq_id)
    if did is None:
        return None
    row = sql.dlq_entry(session.connection(), did)
    return _dlq(row) if row else None


def queue_health(session: Session) -> QueueHealth:
    """Depth by job and state, the oldest due run per job, expired leases, open DLQ entries."""
    now = db_now(session)
    conn = session.connection()
    depth = {(r["job_id"], r["state"]): int(r["n"]) for r in sql.queue_depth(conn)}
    oldest = sql.oldest_due(conn)
    expired = sum(sql.expired_leases(conn).values())
    return QueueHealth(now=now, depth=depth, oldest_due=oldest, expired_leases=expired, dlq_open=sql.dlq_open(conn))


def quota_status(session: Session, workspace_id: str) -> QuotaStatus:
    """``workspace_id``'s quota and load; on a tenant's session RLS shows only its own rows."""
    row = sql.quota_status(session.connection(), workspace_id)
    return QuotaStatus(weight=row["weight"], max_running=row["max_running"], in_flight=int(row["in_flight"]),
                       running=int(row["running"]), held=int(row["held"]))
