"""The five tables, as SQLAlchemy 2.0 typed models — the schema's one source.

Alembic revisions are generated from these classes and a test proves that a
database built by ``upgrade head`` has no drift from them, row-level security
policies included (``rls.py`` declares those next to the tables they guard).

Conventions:

* Every timestamp is ``timestamptz`` and is written with the database's
  ``now()``. A worker's wall clock never decides "is it due" or "has the lease
  expired" (DESIGN.md invariant 6).
* Ids are UUIDs made by Postgres (``gen_random_uuid()``), so a row's identity
  is fixed by the INSERT that creates it and no caller has to mint one.
* ``workspace_id`` is an opaque text tenant id; NULL means a system row
  (cron jobs, health checks), visible to the app role only under
  ``motir.system_admin = 'true'``. Child tables copy it from their run so RLS
  never needs a join.
* Every foreign key is a ``ForeignKey`` with a ``relationship()`` on both
  sides; ``ondelete`` is chosen per edge and mirrored by ``passive_deletes``.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, DOUBLE_PRECISION, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

__all__ = ["Base", "JobEvent", "JobQueue", "JobStep", "JobRun", "JobRunDlq", "JobStatsRollup", "JobBatchItem",
           "JobProgress", "JobStreamItem", "RUN_STATES", "ATTEMPT_OUTCOMES", "FLOW_WAITS"]

#: A run's life: queued → running → (succeeded | failed | cancelled), or back to
#: queued for a retry. Only ``queued`` is claimable.
RUN_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
#: How one attempt ended. ``lost``: its lease expired (worker died or hung);
#: ``suspended``: step.sleep / wait_for_event gave the worker back; ``deferred``:
#: RateLimited put it back. The last two charge no attempt.
ATTEMPT_OUTCOMES = ("running", "succeeded", "retrying", "failed", "cancelled", "lost", "suspended", "deferred")
#: Why a queued run waits on flow control (job_queue.flow_wait): for a start slot of its
#: throttle key, or still gathering events (debounce=, batch=).
FLOW_WAITS = ("throttle", "debounce", "batch")

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TZ = DateTime(timezone=True)
NOW = text("now()")
NEW_UUID = text("gen_random_uuid()")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class JobEvent(Base):
    """One row per ``send_event`` call: the durable log that runs point back to."""

    __tablename__ = "job_event"
    __table_args__ = (
        # Idempotency is per workspace and event name: two tenants may use the same key
        # (each its own order 42) and neither sees the other's event. NULLS NOT DISTINCT:
        # system events (workspace NULL) share one key space, relied upon. Partial: events
        # sent without a key are never deduplicated against each other. Column list of its
        # own (workspace_id first): no other index on job_event starts with it.
        Index(
            "uq_job_event_idempotency",
            "workspace_id",
            "name",
            "idempotency_key",
            unique=True,
            postgresql_nulls_not_distinct=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, server_default=NEW_UUID)
    name: Mapped[str] = mapped_column(Text)
    data: Mapped[Any] = mapped_column(JSONB)
    workspace_id: Mapped[str | None] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    received_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)

    runs: Mapped[list[JobQueue]] = relationship(back_populates="event", passive_deletes=True)
    batch_items: Mapped[list[JobBatchItem]] = relationship(back_populates="event", passive_deletes=True)


class JobQueue(Base):
    """One row per run: the unit a worker claims. Its Celery message carries only the id."""

    __tablename__ = "job_queue"
    __table_args__ = (
        # Fan-out dedup: one run per (event, job). Cron runs have event_id NULL
        # and are never constrained by it — NULLs are distinct, and relied upon.
        UniqueConstraint("event_id", "job_id"),
        # Cron dedup, the other half of the constraint above: one run per
        # (job, slot), and event runs (scheduled_for NULL) pass untouched.
        UniqueConstraint("job_id", "scheduled_for"),
        CheckConstraint(_in("state", RUN_STATES), name="state"),
        CheckConstraint("attempts >= 0 AND max_attempts >= 1", name="attempts"),
        # Due queued runs by run_at: the backlog and "oldest due run" that
        # metrics and `motir doctor` report. Only queued rows are indexed, so the
        # index stays the size of the backlog however many finished runs remain.
        Index("ix_job_queue_due", "run_at", postgresql_where=text("state = 'queued'")),
        # The sweeper's "message went missing" query walks this one: queued runs
        # whose last message is oldest first. On run_at it would have to read
        # every due row of a deep, healthy backlog to find none stale (measured:
        # 7 ms at 10k rows, 248 ms at 1M); on dispatched_at it stops at the first
        # fresh message. Column list of its own.
        Index("ix_job_queue_stale", "dispatched_at", postgresql_where=text("state = 'queued'")),
        # The sweeper's "worker died" query: running rows whose lease ran out.
        # A column list of its own (lease_expires_at), so autogenerate never
        # pairs it with the index above.
        Index("ix_job_queue_leases", "lease_expires_at", postgresql_where=text("state = 'running'")),
        # Operator listings (CLI, dashboard): newest runs of a job.
        Index(None, "job_id", "created_at"),
        # The operator's listing (``motir runs``, the dashboard; reads.LIST_RUNS): the newest runs,
        # read in the listing's own order (created_at DESC, then id) and stopped at its limit, not
        # a sort of the table (10M rows). Migration 0020.
        Index("ix_job_queue_recent", text("created_at DESC"), "id"),
        # One tenant's listing (the app role's rows under RLS, or an admin's --workspace): the same
        # order within one workspace. workspace_id first: no other job_queue index starts with it.
        Index("ix_job_queue_workspace_recent", "workspace_id", text("created_at DESC"), "id"),
        # Subjects (seed 003): "cancel every open run of this subject" (operator.CANCEL_SUBJECT) and
        # "is one active for it" (reads.ACTIVE_FOR_SUBJECT), each an equality on the subject and the
        # workspace. Only open runs that name a subject: its size is the subject work in flight,
        # never the history (10M rows, 90 % finished). Workspace last: the system's runs
        # (workspace NULL, IS NOT DISTINCT FROM) use its subject prefix. Migration 0020.
        Index(
            "ix_job_queue_subject_open",
            "subject_type",
            "subject_id",
            "workspace_id",
            postgresql_where=text("subject_type IS NOT NULL AND state IN ('queued', 'running')"),
        ),
        # Retention (purge.py): finished runs older than a cutoff. Only finished
        # rows are indexed, so queued and running runs cost it nothing.
        Index("ix_job_queue_finished", "finished_at", postgresql_where=text("finished_at IS NOT NULL")),
        # overlap="skip" cron jobs: at most one queued-or-running run per job,
        # decided by this index inside the INSERT of the next slot (beat.py),
        # never by a read-then-insert. Partial, so event jobs and overlap="allow"
        # jobs (skip_overlap false) are never constrained, and its size is the
        # number of skip jobs in flight. Column list (job_id) of its own: no
        # other index is on job_id alone, so autogenerate cannot pair them.
        Index(
            "uq_job_queue_skip_overlap_active",
            "job_id",
            unique=True,
            postgresql_where=text("skip_overlap AND state IN ('queued', 'running')"),
        ),
        # singleton_key=: at most one queued-or-running run per (job, workspace, key),
        # decided by this index inside the fan-out INSERT; the key is free again once
        # the run settles (the row leaves the predicate). Sleeping and waiting runs are
        # queued, so they keep the key. Per workspace: tenants' keys never collide;
        # NULLS NOT DISTINCT, so system runs share one key space (relied upon).
        Index(
            "uq_job_queue_singleton",
            "job_id",
            "workspace_id",
            "singleton_key",
            unique=True,
            postgresql_nulls_not_distinct=True,
            postgresql_where=text("singleton_key IS NOT NULL AND state IN ('queued', 'running')"),
        ),
        # concurrency=(limit, key): the claim counts the running runs of one
        # (job, key) under an advisory lock; this index makes that count read
        # only the running rows of that key. Column list of its own.
        Index(
            "ix_job_queue_concurrency_running",
            "concurrency_key",
            "job_id",
            postgresql_where=text("concurrency_key IS NOT NULL AND state = 'running'"),
        ),
        # cancel_on: an event cancels the job's active runs carrying its key (cancel_by_key, in the
        # send); only active runs with a key are here, so it never reads the job's history.
        # Column list of its own. Migration 0017.
        Index(
            "ix_job_queue_cancel_active",
            "job_id",
            "cancel_key",
            postgresql_where=text("cancel_key IS NOT NULL AND state IN ('queued', 'running')"),
        ),
        # concurrency=: when a slot frees, the key's next run — queued, highest priority, oldest
        # first (next_in_line) — is the first entry here, not a sort of every due run. State as the
        # statement writes it, ``(state = 'queued') IS TRUE`` (store/sql/worker.py; migration 0016).
        Index(
            "ix_job_queue_concurrency_queued",
            "job_id",
            "concurrency_key",
            text("priority DESC"),
            "run_at",
            postgresql_where=text("concurrency_key IS NOT NULL AND (state = 'queued') IS TRUE"),
        ),
        # Admission (core/admission.py; migration 0021): the held runs — queued, no message sent
        # (``dispatched_at = 'infinity'``) — of each workspace, most urgent then oldest first. The
        # dispatcher walks the workspaces along its first column (one probe each, however deep the
        # backlog) and reads each one's head. System runs (NULL) are the workspace ''; a real
        # workspace id is never empty (store/db.py validate_workspace_id). Column list of its own.
        Index(
            "ix_job_queue_held",
            text("coalesce(workspace_id, '')"),
            text("priority DESC"),
            "created_at",
            postgresql_where=text("dispatched_at = 'infinity'::timestamptz AND (state = 'queued') IS TRUE"),
        ),
        # Admission: a workspace's runs in flight (queued with a message sent, or running), counted
        # against its cap and its weight as ``dispatched_at <= now()`` — a range that stops before
        # its held runs ('infinity') and its sleepers (a future instant). Column list of its own.
        # State written ``(state IN (...)) IS TRUE``, as the counts write it: a lookup of one run by
        # id checking ``state IN ('queued', 'running')`` (cancel, revoke) must not prove it.
        Index(
            "ix_job_queue_in_flight",
            text("coalesce(workspace_id, '')"),
            "dispatched_at",
            postgresql_where=text("(state IN ('queued', 'running')) IS TRUE"),
        ),
        # step.wait_for_event: send_event wakes the runs waiting for its event
        # name; only waiting runs are indexed.
        Index("ix_job_queue_waiting", "wait_event", postgresql_where=text("wait_event IS NOT NULL")),
        # "Is any child of this parent still unfinished?" — asked by every child's settle (the
        # trigger motir_run_settled, under the parent's lock) and by a canvas run before it
        # suspends (core/worker/invoke.py): only unfinished children are indexed, so the answer
        # is one lookup however many siblings finished (through the unique index below it read
        # every finished sibling first: quadratic over a chord of 10,000). Column list
        # (parent_run_id) of its own. Migration 0011.
        Index("ix_job_queue_unfinished_children", "parent_run_id",
              postgresql_where=text("parent_run_id IS NOT NULL AND state IN ('queued', 'running')")),
        CheckConstraint("priority BETWEEN 0 AND 9", name="priority"),
        # --- flow control (core/worker/flow.py) and insights (core/worker/rollup.py); migration 0012 ---
        CheckConstraint(_in("flow_wait", FLOW_WAITS), name="flow_wait"),
        # debounce= / batch=: at most one gathering run per (job, workspace, key), found by the
        # sender that adds an event to it (motir_gather, under the key's advisory lock) and closed
        # by the claim; this index is that lookup and the database's own guarantee of "one". NULLS
        # NOT DISTINCT: system runs share one key space, relied upon. Column list of its own.
        # Its state written ``(state = 'queued') IS TRUE`` (migration 0015), as the lookup writes
        # it: that form proves this predicate and no index's of a state alone (ix_job_queue_stale,
        # _due), which statistics of a quiet queue made the planner prefer, a scan of the backlog.
        Index(
            "uq_job_queue_gathering_open",
            "job_id",
            "workspace_id",
            "flow_key",
            unique=True,
            postgresql_nulls_not_distinct=True,
            postgresql_where=text("flow_wait IN ('debounce', 'batch') AND (state = 'queued') IS TRUE"),
        ),
        # throttle=: the runs of a key waiting for a start slot, oldest first — the claim's "is
        # anyone ahead of me?" and the estimate of a newcomer's turn. Only waiting runs are indexed;
        # their state written as above (0015).
        Index(
            "ix_job_queue_throttle_queued",
            "job_id",
            "throttle_key",
            "created_at",
            postgresql_where=text("flow_wait = 'throttle' AND (state = 'queued') IS TRUE"),
        ),
        # The two above as 0012 made them, read by the previous release's statements only (they
        # check ``state = 'queued'``): kept by 0015 (expand), dropped by a later release's contract.
        Index(
            "uq_job_queue_gathering",
            "job_id",
            "workspace_id",
            "flow_key",
            unique=True,
            postgresql_nulls_not_distinct=True,
            postgresql_where=text("flow_wait IN ('debounce', 'batch') AND state = 'queued'"),
        ),
        Index(
            "ix_job_queue_throttle_waiting",
            "job_id",
            "throttle_key",
            "created_at",
            postgresql_where=text("flow_wait = 'throttle' AND state = 'queued'"),
        ),
        # throttle=: the starts of a key, by instant — the claim counts those within the period
        # (newest first, at most the limit) under the key's advisory lock. Only admitted runs of
        # throttled jobs have throttle_at, so no other job's runs are in it.
        Index(
            "ix_job_queue_throttle_starts",
            "job_id",
            "throttle_key",
            "throttle_at",
            postgresql_where=text("throttle_at IS NOT NULL"),
        ),
        # Insights, "show me flaky runs" (store/sql/reads.py FLAKY_RUNS): the newest runs that
        # needed more than one attempt. Sized to the minority ever retried, not to every run.
        # Column list (created_at) of its own.
        Index("ix_job_queue_flaky", "created_at", postgresql_where=text("attempts > 1")),
        # Insights, "the slowest successful runs of a job in a window" (reads.py SLOWEST_RUNS):
        # a job's succeeded runs by finish, never the failed, cancelled or unfinished ones.
        # Column list (job_id, finished_at) of its own.
        Index("ix_job_queue_succeeded", "job_id", "finished_at", postgresql_where=text("state = 'succeeded'")),
        # step.invoke / step.gather: one child per (parent run, step), decided by this
        # constraint inside the INSERT that starts it (core/invoke.py), across retries,
        # crashes and redeliveries of the parent. NULLs are distinct: top-level runs
        # (parent_run_id NULL) are never constrained by it — relied upon. Its index also
        # serves "the children of a run" (the trigger motir_run_settled, the dashboard).
        UniqueConstraint("parent_run_id", "parent_step_id"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, server_default=NEW_UUID)
    job_id: Mapped[str] = mapped_column(Text)
    # NULL for cron runs. RESTRICT: an event is deleted (by purge) only once no
    # run needs it any more.
    event_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("job_event.id", ondelete="RESTRICT"))
    # Copied from the event (or `scheduled.<job_id>` for cron) so the ledger and
    # the handler see one name without a join.
    event_name: Mapped[str] = mapped_column(Text)
    workspace_id: Mapped[str | None] = mapped_column(Text)
    # The cron slot this run is for; NULL for event runs.
    scheduled_for: Mapped[datetime | None] = mapped_column(TZ)
    # True on every row of an overlap="skip" cron job: puts its active run
    # under uq_job_queue_skip_overlap_active. False for everything else.
    skip_overlap: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    state: Mapped[str] = mapped_column(Text, server_default="queued")
    # 0 (default) to 9, higher is more urgent — one direction everywhere: the order in which
    # the dispatcher admits held runs (before any fair share: core/admission.py), a freed
    # concurrency slot or the sweeper picks queued runs, and the Celery message priority where
    # the broker supports it. Seed 003's opposite convention (ascending) is not used here.
    priority: Mapped[int] = mapped_column(SmallInteger, server_default="0")
    # Computed from the triggering event at fan-out (define_job's
    # singleton_key= / concurrency= / cancel_on=), NULL when the job has none.
    singleton_key: Mapped[str | None] = mapped_column(Text)
    concurrency_key: Mapped[str | None] = mapped_column(Text)
    cancel_key: Mapped[str | None] = mapped_column(Text)
    # step.wait_for_event: the event name and the value it must carry at
    # wait_path; NULL unless the run is suspended waiting.
    wait_event: Mapped[str | None] = mapped_column(Text)
    wait_path: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    wait_value: Mapped[str | None] = mapped_column(Text)
    # Times a RateLimited error put the run back without charging an attempt:
    # waiting its turn is not failing.
    deferrals: Mapped[int] = mapped_column(Integer, server_default="0")
    # W3C traceparent active at send_event; the worker's span is its child.
    traceparent: Mapped[str | None] = mapped_column(Text)
    # Not claimable before this instant (retry backoff, RetryAfterError).
    run_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)
    # Charged at claim time, so a run that kills its worker still uses up attempts.
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    # Recorded from the retry policy at enqueue so operators see it and a
    # redeploy with another policy does not change a run in flight.
    max_attempts: Mapped[int] = mapped_column(Integer)
    retry_policy: Mapped[str] = mapped_column(Text)
    # Minted at each claim; every write of the holder is fenced on it.
    claim_token: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    claimed_by: Mapped[str | None] = mapped_column(Text)
    lease_expires_at: Mapped[datetime | None] = mapped_column(TZ)
    # When a message for this run was last handed to the broker; the sweeper
    # re-publishes only runs whose message is old, so a deep queue is not flooded.
    dispatched_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)
    result: Mapped[Any | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)
    finished_at: Mapped[datetime | None] = mapped_column(TZ)
    # The run whose step.invoke / step.gather started this one, and that step's key;
    # NULL for a top-level run. SET NULL: a purged parent leaves its children readable.
    # A child's final state wakes its parent, a cancelled parent cancels its unfinished
    # children: the trigger motir_run_settled (migration 0006, where its SQL is).
    parent_run_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("job_queue.id", ondelete="SET NULL"))
    parent_step_id: Mapped[str | None] = mapped_column(Text)
    # step.invoke(..., detach=True): a child that is not cancelled with its parent (nor
    # when its parent's wait times out). False for every other run.
    detached: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # Flow control, NULL unless the job has throttle= / debounce= / batch= (docs/jobs.md):
    # why the queued run waits, while it does (FLOW_WAITS; shown by the dashboard);
    flow_wait: Mapped[str | None] = mapped_column(Text)
    # debounce= / batch=: the key it gathers events under (within its workspace), kept once closed;
    # when its gathering began (max_wait and the batch timeout run from it); how many events it took.
    flow_key: Mapped[str | None] = mapped_column(Text)
    flow_since: Mapped[datetime | None] = mapped_column(TZ)
    gathered: Mapped[int | None] = mapped_column(Integer)
    # throttle=: the run's key, and the database's instant the run was admitted (its start).
    throttle_key: Mapped[str | None] = mapped_column(Text)
    throttle_at: Mapped[datetime | None] = mapped_column(TZ)
    # The finish the stats rollup has counted: finished_at once folded. A run resumed and
    # finished again differs again, and is counted again (it ended twice).
    folded_at: Mapped[datetime | None] = mapped_column(TZ)
    # An operator's offboarding (``motir cancel --workspace``): who cancelled the run and why,
    # written by the cancelling UPDATE itself (its instant is finished_at). NULL otherwise.
    cancelled_by: Mapped[str | None] = mapped_column(Text)
    cancel_reason: Mapped[str | None] = mapped_column(Text)
    # What the run is about (seed 003's subjectType / subjectId), named by its producer
    # (``subject=(type, id)``): plain text, no FK and no column per subject shape, so a new kind of
    # subject needs no schema change; the id is text, not assumed a UUID. Both or neither.
    subject_type: Mapped[str | None] = mapped_column(Text)
    subject_id: Mapped[str | None] = mapped_column(Text)
    # An audit of what ran the job (seed 003's providerKey / modelVersion): the downstream provider
    # and the model/version, as the job body named them (``step.audit``). Written by the success
    # settle only; never read by the claim.
    provider_key: Mapped[str | None] = mapped_column(String(200))
    model_version: Mapped[str | None] = mapped_column(String(200))

    event: Mapped[JobEvent | None] = relationship(back_populates="runs")
    parent: Mapped[JobQueue | None] = relationship(
        back_populates="children", remote_side=[id], foreign_keys=[parent_run_id]
    )
    children: Mapped[list[JobQueue]] = relationship(
        back_populates="parent", passive_deletes=True, foreign_keys=[parent_run_id]
    )
    resumes: Mapped[list[JobRunDlq]] = relationship(
        back_populates="resumed_run", passive_deletes=True, foreign_keys="JobRunDlq.resumed_run_id"
    )
    steps: Mapped[list[JobStep]] = relationship(back_populates="run", passive_deletes=True)
    attempt_log: Mapped[list[JobRun]] = relationship(back_populates="run", passive_deletes=True)
    dlq_entries: Mapped[list[JobRunDlq]] = relationship(
        back_populates="run", passive_deletes=True, foreign_keys="JobRunDlq.run_id"
    )
    replays: Mapped[list[JobRunDlq]] = relationship(
        back_populates="replay_run", passive_deletes=True, foreign_keys="JobRunDlq.replay_run_id"
    )
    batch_items: Mapped[list[JobBatchItem]] = relationship(back_populates="run", passive_deletes=True)
    progress: Mapped[JobProgress | None] = relationship(back_populates="run", passive_deletes=True)
    stream_items: Mapped[list[JobStreamItem]] = relationship(back_populates="run", passive_deletes=True)


class JobStep(Base):
    """A completed step's memoized result. Its primary key is the memo key."""

    __tablename__ = "job_step"

    # (run_id, step_id) is the primary key, hence unique: a second write of the
    # same step is refused by the database, never by a read-then-insert.
    run_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("job_queue.id", ondelete="CASCADE"), primary_key=True
    )
    step_id: Mapped[str] = mapped_column(Text, primary_key=True)
    workspace_id: Mapped[str | None] = mapped_column(Text)
    output: Mapped[Any] = mapped_column(JSONB)
    # Which attempt stored it (1-based), for `runs show`.
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(TZ)
    completed_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)

    run: Mapped[JobQueue] = relationship(back_populates="steps")


class JobRun(Base):
    """The attempt ledger: one row per claim of a run, and how it ended."""

    __tablename__ = "job_run"
    __table_args__ = (
        # One open attempt per run: settles find the attempt they close by this,
        # not by number, because a suspended (sleep, wait) or deferred attempt is
        # not charged and the resumed one carries the same number.
        Index("uq_job_run_open", "run_id", unique=True, postgresql_where=text("outcome = 'running'")),
        # The ledger of one run, in order (runs show).
        Index("ix_job_run_ledger", "run_id", "started_at"),
        CheckConstraint(_in("outcome", ATTEMPT_OUTCOMES), name="outcome"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("job_queue.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    workspace_id: Mapped[str | None] = mapped_column(Text)
    job_id: Mapped[str] = mapped_column(Text)
    event_name: Mapped[str] = mapped_column(Text)
    worker: Mapped[str] = mapped_column(Text)
    outcome: Mapped[str] = mapped_column(Text, server_default="running")
    # {"type", "message", "traceback"} of the exception that ended the attempt.
    error: Mapped[Any | None] = mapped_column(JSONB)
    started_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)
    finished_at: Mapped[datetime | None] = mapped_column(TZ)

    run: Mapped[JobQueue] = relationship(back_populates="attempt_log")


class JobRunDlq(Base):
    """A run that exhausted its retries: the durable record an operator acts on.

    It copies the function id, event name and data so it stays actionable after
    the run and event are purged (``run_id`` then becomes NULL).
    """

    __tablename__ = "job_run_dlq"
    __table_args__ = (
        # One DLQ entry per failed run; a replay makes a new run with its own.
        UniqueConstraint("run_id"),
        # The operator's listing: a workspace's newest failures first.
        Index("ix_job_run_dlq_recent", "workspace_id", text("last_failed_at DESC")),
        # The two other links to job_queue (ON DELETE SET NULL): without them, deleting a
        # run reads the whole DLQ twice, and purge falls to ~10 runs/s at 50,000 entries
        # (docs/scaling.md, "Retention at depth"). Partial: most entries have neither.
        Index("ix_job_run_dlq_replay_run", "replay_run_id", postgresql_where=text("replay_run_id IS NOT NULL")),
        Index("ix_job_run_dlq_resumed_run", "resumed_run_id", postgresql_where=text("resumed_run_id IS NOT NULL")),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, server_default=NEW_UUID)
    run_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("job_queue.id", ondelete="SET NULL"))
    workspace_id: Mapped[str | None] = mapped_column(Text)
    function_id: Mapped[str] = mapped_column(Text)
    event_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    event_name: Mapped[str] = mapped_column(Text)
    event_data: Mapped[Any] = mapped_column(JSONB)
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    # The last attempt's error, {"type", "message", "traceback"}.
    failure: Mapped[Any] = mapped_column(JSONB)
    attempts: Mapped[int] = mapped_column(Integer)
    first_failed_at: Mapped[datetime] = mapped_column(TZ)
    last_failed_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)
    # Replay audit: set by one conditional UPDATE, so two replays make one run.
    replayed_at: Mapped[datetime | None] = mapped_column(TZ)
    replayed_by: Mapped[str | None] = mapped_column(Text)
    replay_run_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("job_queue.id", ondelete="SET NULL"))
    # An operator decided not to replay; purge may then delete the entry.
    dismissed_at: Mapped[datetime | None] = mapped_column(TZ)
    dismissed_by: Mapped[str | None] = mapped_column(Text)
    # Resume audit (resume_dlq: the same run from its failed step): one conditional
    # UPDATE stamps it, so two resumes queue the run once. It moves run_id here: the
    # entry is closed, and the run, should it fail again, gets an entry of its own
    # under UNIQUE (run_id). SET NULL like run_id.
    resumed_at: Mapped[datetime | None] = mapped_column(TZ)
    resumed_by: Mapped[str | None] = mapped_column(Text)
    resumed_run_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("job_queue.id", ondelete="SET NULL"))

    run: Mapped[JobQueue | None] = relationship(back_populates="dlq_entries", foreign_keys=[run_id])
    resumed_run: Mapped[JobQueue | None] = relationship(back_populates="resumes", foreign_keys=[resumed_run_id])
    replay_run: Mapped[JobQueue | None] = relationship(back_populates="replays", foreign_keys=[replay_run_id])


class JobSweep(Base):
    """The fleet's sweep slot (core/sweeper.py): one row per sweep kind, whose
    ``swept_at`` a conditional UPDATE moves at most once per period."""

    __tablename__ = "job_sweep"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    swept_at: Mapped[datetime] = mapped_column(TZ, server_default=text("'-infinity'"))
    swept_by: Mapped[str | None] = mapped_column(Text)


class JobRegistry(Base):
    """The jobs the fleet defines, as its workers wrote them at start-up (core/registry.py): what
    the app role's checked functions check a job id against (migration 0020). One row per job,
    the union of every worker's jobs; no tenant rows, so no policy (engine role only)."""

    __tablename__ = "job_registry"
    __table_args__ = (CheckConstraint("kind IN ('direct', 'event', 'cron')", name="kind"),)

    job_id: Mapped[str] = mapped_column(Text, primary_key=True)
    #: How a run of it is made: ``direct`` (delay / apply_async), ``event`` (its events), ``cron`` (its beat slot).
    kind: Mapped[str] = mapped_column(Text)
    #: An event job's events; empty for the others.
    events: Mapped[list[str]] = mapped_column(ARRAY(Text), server_default=text("'{}'"))
    #: The last start-up that wrote it, by the database's clock.
    registered_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)
    #: The worker that wrote it last (its Celery hostname).
    registered_by: Mapped[str | None] = mapped_column(Text)


class JobBatchItem(Base):
    """batch=: the events one run gathered, in order (the handler gets them as a list)."""

    __tablename__ = "job_batch_item"
    __table_args__ = (
        # An event's delete checks this (ON DELETE RESTRICT), and purge asks whether a batch still
        # needs an event: both by event_id.
        Index("ix_job_batch_item_event", "event_id"),
    )

    # CASCADE: the items go with their run (purge deletes it, finished, with its steps).
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("job_queue.id", ondelete="CASCADE"), primary_key=True)
    #: 1-based order of arrival; the first is also the run's own event_id.
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    # RESTRICT: an event is deleted only once no batch needs it (as job_queue.event_id).
    event_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("job_event.id", ondelete="RESTRICT"))
    workspace_id: Mapped[str | None] = mapped_column(Text)

    run: Mapped[JobQueue] = relationship(back_populates="batch_items")
    event: Mapped[JobEvent] = relationship(back_populates="batch_items")


class JobProgress(Base):
    """A run's latest progress and its streams' totals (core/worker/streams.py): one row per run that
    reported progress (``step.progress``, a durable Celery task's ``update_state``) or wrote to a
    stream. Advisory: written without waiting for the WAL flush (store/sql/worker.py, ``PROGRESS``).
    Migration 0019."""

    __tablename__ = "job_progress"

    # CASCADE: it goes with its run (purge). The primary key is the upsert's arbiter.
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("job_queue.id", ondelete="CASCADE"), primary_key=True)
    workspace_id: Mapped[str | None] = mapped_column(Text)
    # The custom state (``PROGRESS``...) and its meta; NULL while the run only wrote to streams.
    state: Mapped[str | None] = mapped_column(Text)
    meta: Mapped[Any | None] = mapped_column(JSONB)
    # The attempt that wrote the state: a reader shows it only while that attempt runs.
    attempt: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)
    # The names of the run's streams, in the order they were first written, and what they hold:
    # the bound of MOTIR_MAX_STREAM_BYTES is checked against these, in the write itself.
    streams: Mapped[list[str]] = mapped_column(ARRAY(Text), server_default=text("'{}'"))
    stream_items: Mapped[int] = mapped_column(Integer, server_default="0")
    stream_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")

    run: Mapped[JobQueue] = relationship(back_populates="progress")


class JobStreamItem(Base):
    """One item of one of a run's streams (``step.stream(name).write(x)``). Its position is derived
    from where it was written — the step and its order — so a re-run writes the same positions
    again (overwriting) instead of appending (core/worker/streams.py). Migration 0019."""

    __tablename__ = "job_stream_item"

    # CASCADE: the items go with their run (purge). The primary key is a stream's order: readers
    # read ``position > cursor`` of one (run, stream) along it, and the write's ON CONFLICT arbiter.
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("job_queue.id", ondelete="CASCADE"), primary_key=True)
    stream: Mapped[str] = mapped_column(Text, primary_key=True)
    # segment * 10^9 + order within it (streams.POSITION_STRIDE): a segment is a step's body or
    # the code between two steps, counted in the order the handler reaches them.
    position: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    workspace_id: Mapped[str | None] = mapped_column(Text)
    item: Mapped[Any] = mapped_column(JSONB)
    # The item's JSON length (what the run's bound counts), and the attempt that wrote it.
    bytes: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)

    run: Mapped[JobQueue] = relationship(back_populates="stream_items")


class JobStatsRollup(Base):
    """Per-job outcome counts and durations, folded from finished runs off the hot path
    (core/worker/rollup.py), so they survive purge and worker restarts.

    One row per (job, workspace, 5-minute bucket of ``finished_at``) for the insights' windows
    (kept ``rollup.DETAIL_DAYS``), and one per (job, workspace) with ``bucket`` NULL: the
    all-time totals — the seed's one row per job type, per workspace here so that row-level
    security shows each tenant its own, and what /metrics' counters read. Counts only grow; a
    fold adds a batch of finished runs to them (never a per-settle UPDATE of a hot row).
    """

    __tablename__ = "job_stats_rollup"
    __table_args__ = (
        # The fold's ON CONFLICT arbiter. NULLS NOT DISTINCT: system runs (no workspace) share
        # one row per bucket, and the totals row (bucket NULL) is one per (job, workspace).
        Index("uq_job_stats_rollup", "job_id", "workspace_id", "bucket", unique=True,
              postgresql_nulls_not_distinct=True),
        # The insights' windows (buckets since an instant), /metrics' totals (bucket IS NULL) and
        # the prune of old buckets, all by bucket first. Column list of its own.
        Index("ix_job_stats_rollup_bucket", "bucket"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    job_id: Mapped[str] = mapped_column(Text)
    workspace_id: Mapped[str | None] = mapped_column(Text)
    # The 5-minute bucket of the runs' finished_at; NULL: every run ever (the totals).
    bucket: Mapped[datetime | None] = mapped_column(TZ)
    succeeded_count: Mapped[int] = mapped_column(BigInteger, server_default="0")
    failed_count: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cancelled_count: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # Runs that needed more than one attempt (flaky), and the attempts charged to all runs.
    retried_count: Mapped[int] = mapped_column(BigInteger, server_default="0")
    attempts_count: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # Succeeded runs' durations (first attempt's start to finish). Double precision, never an
    # integer type: a JSON reader takes any double, and a running sum of milliseconds is exact
    # far beyond what any job accumulates (seed 003: JSON.stringify refuses a BigInt).
    sum_duration_ms: Mapped[float] = mapped_column(DOUBLE_PRECISION, server_default="0")
    duration_samples: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # The same durations as a histogram over rollup.DURATION_BOUNDS_MS (one count per bucket, the
    # last for everything longer): p50 / p95 without the runs, and /metrics' _bucket series.
    duration_buckets: Mapped[list[int]] = mapped_column(ARRAY(BigInteger))
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)


class JobQuota(Base):
    """A workspace's share and cap (core/admission.py; migration 0021), changed live by an operator
    (``motir quota set``) and read by the next choice of the dispatcher. No row: weight 1, no cap.

    Row-level security as on the run tables: a tenant reads its own row (what its dashboard shows),
    only the engine role writes. ``workspace_id`` NULL is the system runs' row."""

    __tablename__ = "job_quota"
    __table_args__ = (
        # One row per workspace, and the dispatcher's lookup by its key (system runs: '', as in
        # ix_job_queue_held, so the join is an equality on the same expression).
        Index("uq_job_quota_workspace", text("coalesce(workspace_id, '')"), unique=True),
        CheckConstraint("weight BETWEEN 1 AND 1000", name="weight"),
        CheckConstraint("max_running >= 1", name="max_running"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    workspace_id: Mapped[str | None] = mapped_column(Text)
    # Its share of the fleet's in-flight runs while others wait: the dispatcher gives the next
    # slot to the workspace with the fewest runs in flight per unit of weight.
    weight: Mapped[int] = mapped_column(Integer, server_default="1")
    # At most this many of its runs in flight (a message sent, or running); NULL: no cap.
    max_running: Mapped[int | None] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)
    updated_by: Mapped[str | None] = mapped_column(Text)


class JobAdmission(Base):
    """The fleet's in-flight limit (core/admission.py; migration 0021): one row, ``'fleet'``. No row:
    admission is off and every run is published at once (the behaviour before 0021)."""

    __tablename__ = "job_admission"
    __table_args__ = (CheckConstraint("max_in_flight >= 1", name="max_in_flight"),)

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    # Runs with a message sent or running, fleet-wide; past it new runs are held in Postgres.
    max_in_flight: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=NOW)
    updated_by: Mapped[str | None] = mapped_column(Text)


from motir_celery.store import rls as _rls  # noqa: E402  (policies sit beside the tables they guard)

_rls.declare_workspace_policies(Base.metadata, ["job_event", "job_queue", "job_step", "job_run", "job_run_dlq",
                                                "job_batch_item", "job_stats_rollup", "job_progress",
                                                "job_stream_item", "job_quota"])
_rls.declare_engine_only(Base.metadata, "job_sweep", ("SELECT", "UPDATE"))
_rls.declare_engine_only(Base.metadata, "job_admission", ("SELECT", "INSERT", "UPDATE", "DELETE"))
_rls.declare_engine_only(Base.metadata, "job_registry", ("SELECT", "INSERT", "UPDATE"))
