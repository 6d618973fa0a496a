"""Operator reads: runs, one run in full, the DLQ, queue health.

Every function takes a ``Session`` opened by ``db.workspace_session`` — the app
role, with row-level security enforced — so what a caller can see is decided
by Postgres from the workspace context, never by a ``WHERE`` this module might
forget. The filters here (job, state, workspace) only narrow what RLS already
allows; an admin context (``admin=True``) is what widens it.

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

from sqlalchemy import text
from sqlalchemy.orm import Session

from motir_celery.store.models import RUN_STATES

__all__ = [
    "RunSummary",
    "StepRow",
    "AttemptRow",
    "DlqEntry",
    "RunDetail",
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


_FRESHNESS = text(
    """
    SELECT now() AS now, pg_is_in_recovery() AS standby,
           -- the receiver's pid is the one column of this view every role may read
           EXISTS (SELECT 1 FROM pg_stat_wal_receiver) AS streaming,
           -- replay can be ahead of receive (WAL found in pg_wal at start): that is zero behind
           greatest(pg_wal_lsn_diff(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn()), 0) AS behind,
           -- both clocks (the primary's commit stamp, this server's now()) may differ: never negative
           greatest(extract(epoch FROM now() - pg_last_xact_replay_timestamp()), 0) AS age
    """
)


def freshness(session: Session) -> Freshness:
    """``now()`` and, on a hot standby, how far behind it is: one query, in the caller's transaction.

    On a primary the recovery functions return NULL and ``pg_stat_wal_receiver`` is empty,
    so this costs what ``db_now`` costs. Every function it calls is executable by any role:
    reading it needs no grant.
    """
    row = session.execute(_FRESHNESS).one()
    if not row.standby:
        return Freshness(now=row.now)
    behind = int(row.behind) if row.behind is not None else None
    fresh = Freshness(now=row.now, standby=True, streaming=row.streaming, behind_bytes=behind)
    if fresh.caught_up or row.age is None:
        return fresh
    return dataclasses.replace(fresh, replay_age=float(row.age))


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
    done: bool = session.execute(
        text("SELECT coalesce(pg_last_wal_replay_lsn() >= CAST(:lsn AS pg_lsn), true)"), {"lsn": lsn}
    ).scalar_one()
    return done


def db_now(session: Session) -> datetime:
    now: datetime = session.execute(text("SELECT now()")).scalar_one()
    return now


_RUN_COLUMNS = """
    q.id, q.job_id, q.event_name, q.workspace_id, q.state, q.attempts, q.max_attempts, q.retry_policy,
    q.created_at, q.run_at, q.finished_at, q.claimed_by,
    EXISTS (SELECT 1 FROM job_run_dlq d
            WHERE d.run_id = q.id AND d.replayed_at IS NULL AND d.dismissed_at IS NULL) AS in_dlq
"""


def _summary(row: Any) -> RunSummary:
    return RunSummary(
        id=row.id, job_id=row.job_id, event_name=row.event_name, workspace_id=row.workspace_id,
        state=row.state, attempts=row.attempts, max_attempts=row.max_attempts, retry_policy=row.retry_policy,
        created_at=row.created_at, run_at=row.run_at, finished_at=row.finished_at, claimed_by=row.claimed_by,
        in_dlq=row.in_dlq,
    )


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
    where: list[str] = ["true"]
    params: dict[str, Any] = {"limit": max(1, min(limit, MAX_LIMIT))}
    if job:
        where.append("q.job_id = :job")
        params["job"] = job
    if state:
        where.append("q.state = :state")
        params["state"] = state
    if workspace:
        where.append("q.workspace_id = :workspace")
        params["workspace"] = workspace
    if since is not None:
        where.append("q.created_at >= :since")
        params["since"] = since
    rows = session.execute(
        text(f"SELECT {_RUN_COLUMNS} FROM job_queue q WHERE {' AND '.join(where)} "
             "ORDER BY q.created_at DESC, q.id LIMIT :limit"),
        params,
    ).all()
    return [_summary(r) for r in rows]


_DLQ_COLUMNS = """
    d.id, d.run_id, d.workspace_id, d.function_id, d.event_name, d.event_data, d.failure, d.attempts,
    d.first_failed_at, d.last_failed_at, d.replayed_at, d.replayed_by, d.replay_run_id,
    d.dismissed_at, d.dismissed_by, d.resumed_at, d.resumed_by, d.resumed_run_id, d.idempotency_key
"""


def _dlq(row: Any) -> DlqEntry:
    return DlqEntry(**{k: getattr(row, k) for k in DlqEntry.__dataclass_fields__})


def get_run(session: Session, run_id: uuid.UUID | str) -> RunDetail | None:
    """One run with its event, steps, attempts and DLQ links; ``None`` if absent *or not visible*."""
    rid = as_uuid(run_id)
    if rid is None:
        return None
    row = session.execute(
        text(f"""
            SELECT {_RUN_COLUMNS}, now() AS now, q.event_id, e.data AS event_data, e.idempotency_key,
                   q.scheduled_for, q.lease_expires_at, q.result
            FROM job_queue q LEFT JOIN job_event e ON e.id = q.event_id
            WHERE q.id = :id
        """),
        {"id": rid},
    ).one_or_none()
    if row is None:
        return None
    steps = [
        StepRow(r.step_id, r.attempt, r.started_at, r.completed_at, r.output)
        for r in session.execute(
            text("SELECT step_id, attempt, started_at, completed_at, output FROM job_step "
                 "WHERE run_id = :id ORDER BY started_at, completed_at, step_id"),
            {"id": rid},
        )
    ]
    attempts = [
        AttemptRow(r.attempt, r.worker, r.outcome, r.started_at, r.finished_at, r.error)
        for r in session.execute(
            text("SELECT attempt, worker, outcome, started_at, finished_at, error FROM job_run "
                 "WHERE run_id = :id ORDER BY attempt"),
            {"id": rid},
        )
    ]
    dlq_rows = session.execute(
        text(f"SELECT {_DLQ_COLUMNS} FROM job_run_dlq d WHERE d.run_id = :id OR d.replay_run_id = :id"),
        {"id": rid},
    ).all()
    own = next((_dlq(r) for r in dlq_rows if r.run_id == rid), None)
    replay_of = next((_dlq(r) for r in dlq_rows if r.replay_run_id == rid), None)
    # Composition (issue 20): the parent, the children, the resumes. RLS applies to each row.
    family = session.execute(
        # Two index lookups (the primary key; uq_job_queue_parent_run_id_parent_step_id), not an OR join.
        text("SELECT q.id, q.job_id, q.state, q.parent_step_id, true AS is_parent FROM job_queue q "
             "WHERE q.id = (SELECT parent_run_id FROM job_queue WHERE id = :id) "
             "UNION ALL "
             "SELECT q.id, q.job_id, q.state, q.parent_step_id, false FROM job_queue q WHERE q.parent_run_id = :id"),
        {"id": rid},
    ).all()
    parent = next((ChildRow(r.id, r.job_id, r.state, None) for r in family if r.is_parent), None)
    children = sorted((ChildRow(r.id, r.job_id, r.state, r.parent_step_id) for r in family if not r.is_parent),
                      key=lambda c: _step_order(c.step_id))
    resumes = [_dlq(r) for r in session.execute(
        text(f"SELECT {_DLQ_COLUMNS} FROM job_run_dlq d WHERE d.resumed_run_id = :id ORDER BY d.resumed_at DESC"),
        {"id": rid},
    )]
    return RunDetail(
        run=_summary(row), now=row.now, event_id=row.event_id,
        event_data=row.event_data if row.event_id else {"scheduled_for": row.scheduled_for},
        idempotency_key=row.idempotency_key, scheduled_for=row.scheduled_for,
        lease_expires_at=row.lease_expires_at, result=row.result,
        steps=steps, attempts=attempts, dlq=own, replay_of=replay_of,
        parent=parent, children=children, resumes=resumes,
    )


def _step_order(step_id: str | None) -> tuple[str, int]:
    """``kids[10]`` after ``kids[9]``: a gather's children in call order."""
    if step_id and step_id.endswith("]") and "[" in step_id:
        head, _, index = step_id[:-1].rpartition("[")
        if index.isdigit():
            return head, int(index)
    return step_id or "", -1


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
    where: list[str] = ["true"]
    params: dict[str, Any] = {"limit": max(1, min(limit, MAX_LIMIT))}
    if name:
        where.append("e.name = :name")
        params["name"] = name
    if workspace:
        where.append("e.workspace_id = :workspace")
        params["workspace"] = workspace
    if field_path:
        where.append("e.data #>> CAST(:path AS text[]) = :value")
        params["path"], params["value"] = field_path, value or ""
    rows = session.execute(
        text(f"SELECT e.id, e.name, e.workspace_id, e.idempotency_key, e.received_at, e.data FROM job_event e "
             f"WHERE {' AND '.join(where)} ORDER BY e.received_at DESC, e.id LIMIT :limit"),
        params,
    ).all()
    runs: dict[uuid.UUID, list[ChildRow]] = {}
    if rows:
        for r in session.execute(
            text("SELECT event_id, id, job_id, state FROM job_queue WHERE event_id = ANY(:ids) ORDER BY created_at"),
            {"ids": [r.id for r in rows]},
        ):
            runs.setdefault(r.event_id, []).append(ChildRow(r.id, r.job_id, r.state, None))
    return [EventRow(r.id, r.name, r.workspace_id, r.idempotency_key, r.received_at, r.data, runs.get(r.id, []))
            for r in rows]


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
    where: list[str] = ["true"]
    params: dict[str, Any] = {"limit": max(1, min(limit, MAX_LIMIT))}
    if not include_closed:
        where.append("d.replayed_at IS NULL AND d.dismissed_at IS NULL AND d.resumed_at IS NULL")
    if job:
        where.append("d.function_id = :job")
        params["job"] = job
    if workspace:
        where.append("d.workspace_id = :workspace")
        params["workspace"] = workspace
    rows = session.execute(
        text(f"SELECT {_DLQ_COLUMNS} FROM job_run_dlq d WHERE {' AND '.join(where)} "
             "ORDER BY d.last_failed_at DESC, d.id LIMIT :limit"),
        params,
    ).all()
    return [_dlq(r) for r in rows]


def get_dlq(session: Session, dlq_id: uuid.UUID | str) -> DlqEntry | None:
    did = as_uuid(dlq_id)
    if did is None:
        return None
    row = session.execute(text(f"SELECT {_DLQ_COLUMNS} FROM job_run_dlq d WHERE d.id = :id"), {"id": did}).one_or_none()
    return _dlq(row) if row else None


def queue_health(session: Session) -> QueueHealth:
    """Depth by job and state, the oldest due run per job, expired leases, open DLQ entries."""
    now = db_now(session)
    depth = {
        (r.job_id, r.state): r.n
        for r in session.execute(text("SELECT job_id, state, count(*) AS n FROM job_queue GROUP BY job_id, state"))
    }
    oldest = {
        r.job_id: float(r.age)
        for r in session.execute(text(
            # Due = queued and run_at <= now(): the rows ix_job_queue_due indexes.
            "SELECT job_id, extract(epoch FROM now() - min(run_at)) AS age FROM job_queue "
            "WHERE state = 'queued' AND run_at <= now() GROUP BY job_id"
        ))
    }
    expired = session.execute(
        text("SELECT count(*) FROM job_queue WHERE state = 'running' AND lease_expires_at < now()")
    ).scalar_one()
    dlq_open = session.execute(
        text("SELECT count(*) FROM job_run_dlq WHERE replayed_at IS NULL AND dismissed_at IS NULL AND resumed_at IS NULL")
    ).scalar_one()
    return QueueHealth(now=now, depth=depth, oldest_due=oldest, expired_leases=expired, dlq_open=dlq_open)
