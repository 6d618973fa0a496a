"""The statement catalogue: every statement of the engine's queue, written out plainly.

Each hot statement is a ``Statement`` (``driver.py``): a name, a one-line
description, and its SQL with the reason for each predicate beside it; rows are
read by column name. A run of k new steps costs k + 2 statements, each its own
transaction on the runner's autocommit connection: the claim, one fenced write
per step (committed before the next body starts), the settle. Rules that hold
for every statement here:

* **The database decides.** "Already done?" is a unique constraint
  (``ON CONFLICT DO NOTHING``) or a conditional ``UPDATE``, never a read then a
  write. A conflict comes back as an ordinary value, not an exception.
* **Fenced.** Every write a worker makes on a run it holds is conditional on
  ``claim_token``; a worker whose lease was reclaimed writes nothing.
* **One clock.** "Due", "expired" and every stored instant use the database's
  ``now()``; Python only ever binds *durations* (lease length, backoff).

Functions take a ``Connection`` and leave the transaction to the caller.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Sequence

from sqlalchemy import Connection, text

from motir_celery.settings import get_settings
from motir_celery.store.driver import Statement, first, rows

__all__ = [
    "Claim",
    "RunSpec",
    "Queued",
    "AlreadyQueued",
    "OverlapSkipped",
    "record_event",
    "fan_out",
    "enqueue_scheduled",
    "claim",
    "store_step",
    "renew_lease",
    "renew_leases",
    "renew_claims",
    "settle_succeeded",
    "settle_retry",
    "settle_failed",
    "reclaim_expired",
    "republish_due",
    "take_sweep_slot",
    "cancel",
    "cancel_by_key",
    "spec_params",
    "runs_of",
    "existing_event",
    "find_event",
    "next_in_line",
]


@dataclass(frozen=True)
class RunSpec:
    """One row of a fan-out: the job and the values computed for its run."""

    job_id: str
    max_attempts: int
    policy: str
    priority: int = 0
    singleton_key: str | None = None
    concurrency_key: str | None = None
    cancel_key: str | None = None


@dataclass(frozen=True)
class Queued:
    """A new run was created; publish ``run_id`` after the transaction commits."""

    run_id: uuid.UUID
    job_id: str


@dataclass(frozen=True)
class AlreadyQueued:
    """The run already exists (same event and job, or same cron slot); nothing written."""

    job_id: str


@dataclass(frozen=True)
class Claim:
    run_id: uuid.UUID
    job_id: str
    token: uuid.UUID
    attempt: int
    max_attempts: int
    workspace_id: str | None
    event_id: uuid.UUID | None
    event_name: str
    event_data: Any
    scheduled_for: datetime | None
    steps: dict[str, Any]
    #: The database's now() at claim time: step.sleep and waits compare with it.
    db_now: datetime | None = None
    concurrency_key: str | None = None
    traceparent: str | None = None


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


# --- enqueue ------------------------------------------------------------------------

# The runs of one event ``e`` (a CTE of id, name, workspace_id), one per RunSpec
# (fan_out; motir_record_event has the same INSERT for the event it writes).
_RUNS_OF_E = """
      INSERT INTO job_queue (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy,
                             priority, singleton_key, concurrency_key, cancel_key, traceparent)
      SELECT e.id, s.job_id, e.name, e.workspace_id, s.max_attempts, s.retry_policy,
             s.priority, s.singleton_key, s.concurrency_key, s.cancel_key, %(traceparent)s
      FROM e,
           unnest(CAST(%(job_ids)s AS text[]), CAST(%(max_attempts)s AS int[]), CAST(%(policies)s AS text[]),
                  CAST(%(priorities)s AS smallint[]), CAST(%(singletons)s AS text[]),
                  CAST(%(concurrency)s AS text[]), CAST(%(cancel_keys)s AS text[]))
             AS s(job_id, max_attempts, retry_policy, priority, singleton_key, concurrency_key, cancel_key)
      -- No conflict target: one run per (event, job) — dispatching the same event
      -- twice adds nothing — and one active run per (job, singleton_key).
      ON CONFLICT DO NOTHING
      RETURNING id, job_id
"""

# The event, its runs and the wake-up of runs waiting for it, in one statement:
# the function motir_record_event (migrations/versions/0004_record_event_function.py,
# where its SQL is written out and explained). Its rows: (woken, event_id, run_id, job_id).
RECORD_EVENT = Statement(
    "record_event",
    "Write an event, one run per subscribing job, and wake the runs waiting for it (one statement).",
    """
    SELECT * FROM motir_record_event(
      %(name)s, CAST(%(data)s AS jsonb), %(workspace_id)s, %(key)s, %(traceparent)s,
      CAST(%(job_ids)s AS text[]), CAST(%(max_attempts)s AS int[]), CAST(%(policies)s AS text[]),
      CAST(%(priorities)s AS smallint[]), CAST(%(singletons)s AS text[]), CAST(%(concurrency)s AS text[]),
      CAST(%(cancel_keys)s AS text[]))
    """
)


def spec_params(specs: Sequence[RunSpec], traceparent: str | None) -> dict[str, Any]:
    """RECORD_EVENT's (and FAN_OUT's) run parameters: one array per RunSpec field."""
    return {
        "job_ids": [s.job_id for s in specs],
        "max_attempts": [s.max_attempts for s in specs],
        "policies": [s.policy for s in specs],
        "priorities": [s.priority for s in specs],
        "singletons": [s.singleton_key for s in specs],
        "concurrency": [s.concurrency_key for s in specs],
        "cancel_keys": [s.cancel_key for s in specs],
        "traceparent": traceparent,
    }


def runs_of(specs: Sequence[RunSpec], created_rows: Sequence[dict[str, Any]]) -> list[Queued | AlreadyQueued]:
    """One entry per spec: ``Queued`` for the runs a statement created, ``AlreadyQueued`` for the rest."""
    created = {r["job_id"]: r["run_id"] for r in created_rows if r["run_id"] is not None}
    return [Queued(created[s.job_id], s.job_id) if s.job_id in created else AlreadyQueued(s.job_id)
            for s in specs]


def record_event(
    conn: Connection, name: str, data_json: str, workspace_id: str | None, idempotency_key: str | None,
    specs: Sequence[RunSpec], *, traceparent: str | None = None,
) -> tuple[uuid.UUID | None, list[Queued | AlreadyQueued], list[Queued]]:
    """Write the event and one run per spec, and make due the runs suspended
    waiting for it: (event id, runs, woken runs), in one statement. The event id
    is ``None`` when its idempotency key was already used for this name.

    On a connection in autocommit the statement is its own transaction: the event
    is committed (and flushed) when this returns.
    """
    params = {"name": name, "data": data_json, "workspace_id": workspace_id, "key": idempotency_key,
              **spec_params(specs, traceparent)}
    found = rows(conn, RECORD_EVENT, params)
    recorded = [r for r in found if not r["woken"]]
    if not recorded:
        return None, [], []
    woken_runs = [Queued(r["run_id"], r["job_id"]) for r in found if r["woken"]]
    return recorded[0]["event_id"], runs_of(specs, recorded), woken_runs


EXISTING_EVENT = Statement(
    "existing_event",
    "What a refused event's idempotency key stands for in its workspace: the event, and whether its data is this call's.",
    """
    SELECT id, data = CAST(%(data)s AS jsonb) AS same          -- same data, or one key with two meanings
    FROM job_event
    WHERE workspace_id IS NOT DISTINCT FROM %(workspace_id)s     -- keys are per workspace: another's is not ours
      AND name = %(name)s AND idempotency_key = %(key)s          -- the key's event (uq_job_event_idempotency)
    """,
)


def existing_event(conn: Connection, name: str, data_json: str, workspace_id: str | None,
                   key: str | None) -> dict[str, Any] | None:
    """The event an idempotency key already made in ``workspace_id`` (``id``, ``same``), or None."""
    return first(conn, EXISTING_EVENT, {"name": name, "data": data_json, "workspace_id": workspace_id, "key": key})


FAN_OUT = Statement(
    "fan_out",
    "One run per subscribing job for an event already recorded, deduplicated by (event_id, job_id).",
    "WITH e AS (SELECT id, name, workspace_id FROM job_event WHERE id = %(event_id)s), runs AS ("
    + _RUNS_OF_E
    + ") SELECT id AS run_id, job_id FROM runs",
)


def fan_out(
    conn: Connection, event_id: uuid.UUID, specs: Sequence[RunSpec], *, traceparent: str | None = None
) -> list[Queued | AlreadyQueued]:
    """One run per spec for a recorded event, deduplicated by the database."""
    if not specs:
        return []
    return runs_of(specs, rows(conn, FAN_OUT, {"event_id": event_id, **spec_params(specs, traceparent)}))


CANCEL_BY_KEY = Statement(
    "cancel_by_key",
    "cancel_on: cancel a job's active runs of one workspace whose triggering event carried the key.",
    """
    WITH cancelled AS (
      UPDATE job_queue
      SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL,
          wait_event = NULL
      WHERE job_id = %(job_id)s
        AND cancel_key = %(key)s                                -- the cancel_on rule's field matched
        AND workspace_id IS NOT DISTINCT FROM %(workspace_id)s  -- the event's own workspace (system: system runs)
        AND state IN ('queued', 'running')                      -- a finished run stays as it ended
        AND (CAST(%(within)s AS float8) IS NULL
             OR created_at > now() - make_interval(secs => CAST(%(within)s AS float8)))   -- the rule's timeout
      RETURNING id
    ), ledger AS (
      UPDATE job_run r SET outcome = 'cancelled', finished_at = now()
      FROM cancelled c WHERE r.run_id = c.id AND r.outcome = 'running'
    )
    SELECT id FROM cancelled
    """,
)


def cancel_by_key(conn: Connection, job_id: str, key: str, within_seconds: float | None,
                  workspace_id: str | None) -> list[uuid.UUID]:
    """cancel_on: cancel the job's active runs in ``workspace_id`` whose triggering event carried ``key``."""
    params = {"job_id": job_id, "key": key, "within": within_seconds, "workspace_id": workspace_id}
    return [r["id"] for r in rows(conn, CANCEL_BY_KEY, params)]


_ENQUEUE_SCHEDULED = text(
    """
    INSERT INTO job_queue (job_id, scheduled_for, event_name, workspace_id, max_attempts, retry_policy,
                           priority, concurrency_key)
    -- scheduled_for is bound from Python, and that is safe: it is a cron slot
    -- computed from (expression, zone, the database's now()), not a reading of
    -- this process's clock, so every beat binds the same instant for one slot.
    VALUES (:job_id, :scheduled_for, :event_name, NULL, :max_attempts, :policy, :priority, :concurrency_key)
    -- one run per (job, slot), however many beats tick it.
    ON CONFLICT (job_id, scheduled_for) DO NOTHING
    RETURNING id
    """
)

# overlap="skip". The decision is the database's, inside the INSERT: the row is
# inserted with skip_overlap = true, so uq_job_queue_skip_overlap_active (one
# queued-or-running skip_overlap row per job) refuses it while another run of
# the job is active. Unlike `INSERT … WHERE NOT EXISTS (active run)`, which two
# transactions under READ COMMITTED can both pass before either commits, a
# unique index makes the second inserter wait for the first and then conflict
# (or proceed if the first rolled back), at any isolation level. REJECTED: an
# advisory lock + check, which is only as safe as every writer remembering the
# lock, and is broken under REPEATABLE READ (the check's snapshot predates the
# wait). No conflict target: both arbiters apply — (job_id, scheduled_for) says
# "this slot exists", the partial index says "a run is active".
_ENQUEUE_SCHEDULED_SKIPPING = text(
    """
    INSERT INTO job_queue (job_id, scheduled_for, event_name, workspace_id, max_attempts, retry_policy,
                           priority, concurrency_key, skip_overlap)
    VALUES (:job_id, :scheduled_for, :event_name, NULL, :max_attempts, :policy, :priority, :concurrency_key, true)
    ON CONFLICT DO NOTHING
    RETURNING id
    """
)

# The slot was refused. If the slot itself exists, this conflicts too
# (AlreadyQueued); otherwise the active run blocked it, and the skip is written
# down as a finished row for the slot, so a beat arriving later (after the
# blocking run ended) finds the slot taken instead of running it late.
_RECORD_SKIP = text(
    """
    INSERT INTO job_queue (job_id, scheduled_for, event_name, workspace_id, max_attempts, retry_policy,
                           skip_overlap, state, finished_at, result)
    VALUES (:job_id, :scheduled_for, :event_name, NULL, :max_attempts, :policy,
            true, 'cancelled', now(),
            jsonb_build_object('skipped', 'overlap', 'blocking_run_id',
              (SELECT id FROM job_queue       -- served by the partial index; NULL if it just ended
               WHERE job_id = :job_id AND skip_overlap AND state IN ('queued', 'running') LIMIT 1)))
    ON CONFLICT (job_id, scheduled_for) DO NOTHING
    RETURNING id, result ->> 'blocking_run_id' AS blocking
    """
)


@dataclass(frozen=True)
class OverlapSkipped(AlreadyQueued):
    """An ``overlap="skip"`` job's slot was not run: another run of the job was queued
    or running. The skip is recorded as a ``cancelled`` row for the slot (``run_id``),
    so every beat, now or later, gets the same answer for it."""

    run_id: uuid.UUID
    blocking_run_id: uuid.UUID | None


def enqueue_scheduled(
    conn: Connection, job_id: str, scheduled_for: datetime, *, max_attempts: int, policy: str,
    priority: int = 0, concurrency_key: str | None = None, skip_overlap: bool = False,
) -> Queued | AlreadyQueued:
    """The run of one cron slot: ``Queued``, ``AlreadyQueued`` or (skip_overlap) ``OverlapSkipped``."""
    if scheduled_for.tzinfo is None:
        raise ValueError("scheduled_for must be timezone-aware")
    params = {"job_id": job_id, "scheduled_for": scheduled_for, "event_name": f"scheduled.{job_id}",
              "max_attempts": max_attempts, "policy": policy, "priority": priority,
              "concurrency_key": concurrency_key}
    if not skip_overlap:
        run_id = conn.execute(_ENQUEUE_SCHEDULED, params).scalar()
        return Queued(run_id, job_id) if run_id is not None else AlreadyQueued(job_id)
    run_id = conn.execute(_ENQUEUE_SCHEDULED_SKIPPING, params).scalar()
    if run_id is not None:
        return Queued(run_id, job_id)
    skipped = conn.execute(_RECORD_SKIP, params).one_or_none()
    if skipped is None:
        return AlreadyQueued(job_id)
    blocking = uuid.UUID(skipped.blocking) if skipped.blocking else None
    return OverlapSkipped(job_id, skipped.id, blocking)


# --- direct runs (job.delay / apply_async) and their results -------------------------

DIRECT_RUN = Statement(
    "direct_run",
    "Write a direct run's event (direct.<job_id>, its arguments) and its one run, due at run_at (one statement).",
    # motir_direct_run (migration 0008): the engine role's write, or for anyone else the
    # checked function that writes only in the transaction's workspace.
    """
    SELECT * FROM motir_direct_run(
      %(name)s, CAST(%(data)s AS jsonb), %(workspace_id)s, %(key)s, CAST(%(eta)s AS timestamptz),
      CAST(%(countdown)s AS float8), %(job_id)s, %(max_attempts)s, %(policy)s, CAST(%(priority)s AS smallint),
      %(singleton)s, %(concurrency)s, %(cancel_key)s, %(traceparent)s, CAST(%(after)s AS float8))
    """,
)

#: DIRECT_RUN on a schema before 0008 (the code deployed before its migration; store/schema.py).
DIRECT_RUN_BEFORE_0008 = Statement(
    "direct_run_before_0008",
    "DIRECT_RUN as one statement of its own, for a schema that has no motir_direct_run yet.",
    """
    WITH e AS (
      INSERT INTO job_event (name, data, workspace_id, idempotency_key)
      VALUES (%(name)s, CAST(%(data)s AS jsonb), %(workspace_id)s, %(key)s)
      -- (name, idempotency_key) is unique and the name is the job's own: a key
      -- (Celery's task_id) used twice for this job writes nothing. NULL keys never conflict.
      ON CONFLICT DO NOTHING
      RETURNING id, name, workspace_id
    ), due AS (
      -- countdown is a duration on the database's clock; eta an absolute instant the
      -- caller chose (bound as timestamptz, so its zone is kept). Never this process's clock.
      SELECT coalesce(CAST(%(eta)s AS timestamptz), now() + make_interval(secs => %(countdown)s)) AS run_at
    ), runs AS (
      INSERT INTO job_queue (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy, priority,
                             singleton_key, concurrency_key, cancel_key, traceparent, run_at, dispatched_at)
      SELECT e.id, %(job_id)s, e.name, e.workspace_id, %(max_attempts)s, %(policy)s, %(priority)s,
             %(singleton)s, %(concurrency)s, %(cancel_key)s, %(traceparent)s, due.run_at,
             -- due later than republish_after: no message now, the sweeper publishes it once due
             -- ("message older than republish_after" then holds at run_at); else published now.
             greatest(now(), due.run_at - make_interval(secs => %(after)s))
      FROM e, due
      -- No conflict target: one run per (event, job), one active run per (job, singleton_key).
      ON CONFLICT DO NOTHING
      RETURNING id, run_at
    )
    SELECT e.id AS event_id, runs.id AS run_id,
           -- seconds until due by the database's clock: the Celery countdown of its message
           extract(epoch FROM runs.run_at - now())::float8 AS due_in
    FROM e LEFT JOIN runs ON true
    """,
)

DIRECT_RUN_EXISTING = Statement(
    "direct_run_existing",
    "The run a refused direct run stands for: the one its idempotency key made, or the active run of its singleton key.",
    """
    (SELECT q.id AS run_id, e.data = CAST(%(data)s AS jsonb) AS same   -- same arguments, or a key with two meanings
     FROM job_event e JOIN job_queue q ON q.event_id = e.id
     WHERE e.workspace_id IS NOT DISTINCT FROM %(workspace_id)s   -- keys are per workspace
       AND e.name = %(name)s AND e.idempotency_key = %(key)s     -- the key's event (uq_job_event_idempotency)
       AND q.job_id = %(job_id)s)                                 -- and its run
    UNION ALL
    (SELECT id, NULL FROM job_queue
     WHERE job_id = %(job_id)s AND singleton_key = %(singleton)s   -- uq_job_queue_singleton refused it
       AND workspace_id IS NOT DISTINCT FROM %(workspace_id)s      -- in this workspace
       AND state IN ('queued', 'running'))
    LIMIT 1
    """,
)

RUN_RESULT = Statement(
    "run_result",
    "A run's state, result and how its latest attempt ended, in the caller's workspace (the result handle's .state and .get).",
    """
    SELECT q.state, q.result, q.attempts, r.outcome AS last_outcome, r.error AS last_error
    FROM job_queue q
    LEFT JOIN LATERAL (
      SELECT outcome, error FROM job_run
      WHERE run_id = q.id                      -- this run's ledger (ix_job_run_ledger)
      ORDER BY started_at DESC LIMIT 1         -- its latest attempt: retrying, failed, lost...
    ) r ON true
    WHERE q.id = %(run_id)s
      AND q.workspace_id IS NOT DISTINCT FROM %(workspace_id)s   -- another workspace's run is not found
    """,
)


# --- claim ------------------------------------------------------------------------

CLAIM = Statement(
    "claim",
    "Move a queued, due run to running for one worker; its event and memoized steps in the same round trip.",
    """
    WITH claimed AS (
      UPDATE job_queue
      SET state = 'running',
          attempts = attempts + 1,             -- charged now: a run that kills its worker still spends attempts
          -- fences every later write to this holder; minted by the worker when it passes one
          -- (its renewer then knows the token before this commits: core/leases.py)
          claim_token = coalesce(CAST(%(token)s AS uuid), gen_random_uuid()),
          claimed_by = %(worker)s,
          lease_expires_at = now() + make_interval(secs => %(lease)s),
          wait_event = NULL, wait_path = NULL, wait_value = NULL   -- a woken waiter waits no more
      WHERE id = %(run_id)s
        AND job_id = %(job_id)s                -- a message for another job's run (misrouted, forged) claims nothing
        AND state = 'queued'                   -- running: someone holds it; final: done. Either way a stale message.
        AND run_at <= now()                    -- not due yet (backoff): the sweeper publishes it again when it is
        AND (CAST(%(limit)s AS int) IS NULL    -- concurrency=(limit, key): a free slot, counted under
             OR (SELECT count(*) FROM job_queue r          -- lock_concurrency's advisory lock
                 WHERE r.concurrency_key = job_queue.concurrency_key AND r.job_id = job_queue.job_id
                   -- a key is per workspace; the whole-job limit (key '') spans them all
                   AND (job_queue.concurrency_key = ''
                        OR r.workspace_id IS NOT DISTINCT FROM job_queue.workspace_id)
                   AND r.state = 'running') < CAST(%(limit)s AS int))
      RETURNING id, job_id, claim_token, attempts, max_attempts, workspace_id, event_id, event_name, scheduled_for,
                concurrency_key, traceparent
    ), ledger AS (
      INSERT INTO job_run (run_id, attempt, workspace_id, job_id, event_name, worker)
      SELECT id, attempts, workspace_id, job_id, event_name, %(worker)s FROM claimed
    )
    SELECT c.id AS run_id, c.job_id, c.claim_token AS token, c.attempts AS attempt, c.max_attempts,
           c.workspace_id, c.event_id, c.event_name, e.data AS event_data, c.scheduled_for,
           -- memoized steps in the same round trip (snapshot taken before this claim: prior attempts' steps)
           (SELECT coalesce(jsonb_object_agg(s.step_id, s.output), '{}'::jsonb)
              FROM job_step s WHERE s.run_id = c.id) AS steps,
           now() AS db_now, c.concurrency_key, c.traceparent,
           -- MOTIR_CLAIM_ASYNC_COMMIT (on by default): this commit does not wait for the
           -- WAL flush. Hazard: a crash of Postgres itself may lose the claim; the run is
           -- then queued again with the attempt uncharged, and no step is lost, because
           -- every step record and settle after it is a flushed commit later in the WAL.
           CASE WHEN %(async_commit)s THEN set_config('synchronous_commit', 'off', true) END AS async_commit
    FROM claimed c LEFT JOIN job_event e ON e.id = c.event_id
    """,
)


_LOCK_CONCURRENCY = text(
    """
    SELECT pg_advisory_xact_lock(hashtextextended(job_id || chr(31) || concurrency_key, 0))
    FROM job_queue WHERE id = :run_id AND concurrency_key IS NOT NULL
    """
)


def lock_concurrency(conn: Connection, run_id: uuid.UUID) -> None:
    """Serialise claims of one (job, concurrency key) until this transaction ends, so
    two workers cannot both count the last free slot (cold path: jobs with concurrency=)."""
    conn.execute(_LOCK_CONCURRENCY, {"run_id": run_id})


def claim(conn: Connection, run_id: uuid.UUID, *, job_id: str, worker: str, lease_seconds: float,
          concurrency_limit: int | None = None, token: uuid.UUID | None = None) -> Claim | None:
    """Move a queued, due run to running for this worker; ``None`` if it is not ours to run."""
    row = first(conn, CLAIM, {"run_id": run_id, "job_id": job_id, "worker": worker, "lease": lease_seconds,
                              "limit": concurrency_limit, "async_commit": get_settings().claim_async_commit,
                              "token": token})
    if row is None:
        return None
    del row["async_commit"]
    return Claim(**row)


_NEXT_IN_LINE = text(
    """
    WITH next AS (
      SELECT id FROM job_queue
      WHERE job_id = :job_id AND concurrency_key = :key
        AND (:key = '' OR workspace_id IS NOT DISTINCT FROM :workspace_id)   -- the freed slot's workspace
        AND state = 'queued' AND run_at <= now()   -- waiting for a slot, due
      ORDER BY priority DESC, run_at               -- priority decides who gets a freed slot
      LIMIT 1
      FOR UPDATE SKIP LOCKED
    )
    UPDATE job_queue q SET dispatched_at = now() FROM next WHERE q.id = next.id
    RETURNING q.id
    """
)


def next_in_line(conn: Connection, job_id: str, key: str, workspace_id: str | None) -> uuid.UUID | None:
    """The queued run that should take a concurrency slot just freed (publish it after commit)."""
    return conn.execute(_NEXT_IN_LINE, {"job_id": job_id, "key": key, "workspace_id": workspace_id}).scalar()


# --- step write and heartbeat --------------------------------------------------------

STORE_STEP = Statement(
    "store_step",
    "Store one finished step's result, fenced on the claim token; committed before the next body starts.",
    """
    WITH run AS (
      SELECT id, workspace_id, attempts FROM job_queue
      WHERE id = %(run_id)s
        AND claim_token = %(token)s            -- fence: only the current holder writes
        AND state = 'running'                  -- a cancelled run stops at its next step boundary
      -- FOR SHARE: a concurrent reclaim or cancel waits for this insert to commit, or
      -- this statement re-checks the fence against the reclaimed row and writes nothing.
      FOR SHARE
    )
    INSERT INTO job_step (run_id, step_id, workspace_id, output, attempt, started_at)
    SELECT id, %(step_id)s, workspace_id, CAST(%(output)s AS jsonb), attempts,
           now() - make_interval(secs => %(elapsed)s)
    FROM run
    ON CONFLICT (run_id, step_id) DO NOTHING   -- stored already (a racing duplicate): the stored value wins
    RETURNING 1 AS stored
    """,
)


def store_step(conn: Connection, claim_: Claim, step_id: str, output_json: str, elapsed: float) -> bool:
    """Store one step; ``False`` when nothing was written (fenced, or stored already)."""
    params = {"run_id": claim_.run_id, "token": claim_.token, "step_id": step_id, "output": output_json,
              "elapsed": elapsed}
    return first(conn, STORE_STEP, params) is not None


_RENEW_LEASE = text(
    """
    UPDATE job_queue SET lease_expires_at = now() + make_interval(secs => :lease)
    WHERE id = :run_id AND claim_token = :token AND state = 'running'   -- fence
    RETURNING 1
    """
)

_RENEW_LEASES = text(
    """
    UPDATE job_queue q SET lease_expires_at = now() + make_interval(secs => :lease)
    FROM unnest(CAST(:run_ids AS uuid[]), CAST(:tokens AS uuid[])) AS h(run_id, token)
    WHERE q.id = h.run_id
      AND q.claim_token = h.token              -- fence: each holder renews only its own claim
      AND q.state = 'running'                  -- a settled or cancelled run is not renewed
    RETURNING q.id
    """
)


def renew_leases(conn: Connection, claims: Sequence[Claim], lease_seconds: float) -> set[uuid.UUID]:
    """The heartbeat of every run a process holds, in one statement; the run ids still held."""
    params = {"lease": lease_seconds, "run_ids": [c.run_id for c in claims], "tokens": [c.token for c in claims]}
    return set(conn.execute(_RENEW_LEASES, params).scalars())


_STORE_CLOCK_STEP = text(
    """
    INSERT INTO job_step (run_id, step_id, workspace_id, output, attempt, started_at)
    SELECT q.id, :step_id, q.workspace_id,
           -- both instants from the database clock (or the caller's absolute instant)
           jsonb_build_object('since', now(),
                              'until', coalesce(CAST(:until AS timestamptz),
                                                now() + make_interval(secs => CAST(:secs AS float8)))),
           q.attempts, now()
    FROM job_queue q
    WHERE q.id = :run_id AND q.claim_token = :token AND q.state = 'running'   -- fence
    FOR SHARE OF q
    ON CONFLICT (run_id, step_id) DO NOTHING
    RETURNING output, now() AS db_now
    """
)


def store_clock_step(conn: Connection, claim_: Claim, step_id: str, *, seconds: float | None = None,
                     until: datetime | None = None) -> tuple[Any, datetime] | None:
    """Memoize {"since": now(), "until": now() + seconds | until} for step.sleep / waits.
    Returns (output, db_now), or None when fenced."""
    row = conn.execute(
        _STORE_CLOCK_STEP,
        {"run_id": claim_.run_id, "token": claim_.token, "step_id": step_id, "secs": seconds, "until": until},
    ).one_or_none()
    return None if row is None else (row.output, row.db_now)


_SUSPEND = text(
    """
    WITH settled AS (
      UPDATE job_queue
      SET state = 'queued',
          run_at = coalesce(CAST(:until AS timestamptz), now() + make_interval(secs => CAST(:delay AS float8))),
          attempts = attempts - 1,                -- a sleep, a wait or a rate-limit deferral is not a failure
          deferrals = deferrals + CAST(:deferred AS int),
          -- the sweeper publishes it once due: "message older than republish_after" then holds at run_at
          dispatched_at = coalesce(CAST(:until AS timestamptz), now() + make_interval(secs => CAST(:delay AS float8)))
                          - make_interval(secs => CAST(:after AS float8)),
          wait_event = :wait_event, wait_path = CAST(:wait_path AS text[]), wait_value = :wait_value,
          claim_token = NULL, claimed_by = NULL, lease_expires_at = NULL
      WHERE id = :run_id AND claim_token = :token AND state = 'running'   -- fence
      RETURNING id, run_at
    ), ledger AS (
      UPDATE job_run r SET outcome = :outcome, finished_at = now(), error = CAST(:error AS jsonb)
      FROM settled s WHERE r.run_id = s.id AND r.outcome = 'running'
    )
    SELECT run_at FROM settled
    """
)


def suspend(conn: Connection, claim_: Claim, *, outcome: str, until: datetime | None = None,
            delay: float | None = None, republish_after: float, error_json: str | None = None,
            wait: tuple[str, list[str], str | None] | None = None) -> datetime | None:
    """Give the worker back without charging the attempt: queued again at ``until``
    (or ``now() + delay``). Returns the new run_at, or None when fenced."""
    name, path, value = wait or (None, None, None)
    return conn.execute(
        _SUSPEND,
        {"run_id": claim_.run_id, "token": claim_.token, "outcome": outcome, "until": until, "delay": delay,
         "deferred": 1 if outcome == "deferred" else 0, "after": republish_after, "error": error_json,
         "wait_event": name, "wait_path": path, "wait_value": value},
    ).scalar()


_LOCK_WAIT = text("SELECT pg_advisory_xact_lock(hashtext('motir.wait:' || :name))")
FIND_EVENT = Statement(
    "find_event",
    "step.wait_for_event's look-back: the first event of a name, in the run's workspace, matching since the wait began.",
    """
    SELECT id, name, data, received_at FROM job_event
    WHERE name = %(name)s
      AND workspace_id IS NOT DISTINCT FROM %(workspace_id)s   -- the waiting run's workspace (system: system events)
      AND data #>> CAST(%(path)s AS text[]) = %(value)s      -- the waiter's field, as text
      AND received_at >= %(since)s                           -- only events since the wait began
    ORDER BY received_at
    LIMIT 1
    """,
)


def lock_wait(conn: Connection, name: str) -> None:
    """Exclusive twin of record_event's shared lock: after it, every event of ``name``
    committed so far is visible, and every later one will see this transaction's waiter."""
    conn.execute(_LOCK_WAIT, {"name": name})


def find_event(conn: Connection, name: str, path: list[str], value: str | None, since: datetime,
               workspace_id: str | None) -> dict[str, Any] | None:
    """The event a waiter of ``workspace_id`` looks back for (``id``, ``name``, ``data``), or None."""
    if value is None:
        return None
    return first(conn, FIND_EVENT, {"name": name, "path": path, "value": value, "since": since,
                                    "workspace_id": workspace_id})


def renew_lease(conn: Connection, claim_: Claim, lease_seconds: float) -> bool:
    return (
        conn.execute(_RENEW_LEASE, {"run_id": claim_.run_id, "token": claim_.token, "lease": lease_seconds}).scalar()
        is not None
    )


_RUN_STATE = text("SELECT state, claim_token = :token AS ours FROM job_queue WHERE id = :run_id")


def why_fenced(conn: Connection, claim_: Claim) -> str:
    """Cold path after a refused write: 'cancelled', 'lost' (reclaimed) or 'held' (still ours)."""
    row = conn.execute(_RUN_STATE, {"run_id": claim_.run_id, "token": claim_.token}).one_or_none()
    if row is None:
        return "lost"
    if row.state == "cancelled":
        return "cancelled"
    return "held" if row.ours else "lost"


def stored_output(conn: Connection, claim_: Claim, step_id: str) -> Any:
    return conn.execute(
        text("SELECT output FROM job_step WHERE run_id = :run_id AND step_id = :step_id"),
        {"run_id": claim_.run_id, "step_id": step_id},
    ).scalar_one()


# --- settle ---------------------------------------------------------------------

SETTLE_SUCCEEDED = Statement(
    "settle_succeeded",
    "Mark a run succeeded with its result and close the attempt's ledger row, fenced on the claim token.",
    """
    WITH settled AS (
      UPDATE job_queue
      SET state = 'succeeded', result = CAST(%(result)s AS jsonb), finished_at = now(),
          claim_token = NULL, lease_expires_at = NULL
      WHERE id = %(run_id)s
        AND claim_token = %(token)s            -- fence: only the current holder settles
        AND state = 'running'                  -- a cancelled run stays cancelled
      RETURNING id
    ), ledger AS (
      UPDATE job_run r SET outcome = 'succeeded', finished_at = now()
      FROM settled s WHERE r.run_id = s.id
        AND r.outcome = 'running'              -- the open attempt, not an earlier one
    )
    SELECT count(*) AS settled FROM settled
    """,
)


def settle_succeeded(conn: Connection, claim_: Claim, result_json: str) -> bool:
    """Settle a run that succeeded; ``False`` when fenced (cancelled or reclaimed)."""
    row = first(conn, SETTLE_SUCCEEDED, {"run_id": claim_.run_id, "token": claim_.token, "result": result_json})
    return row is not None and row["settled"] == 1


_SETTLE_RETRY = text(
    """
    WITH settled AS (
      UPDATE job_queue
      SET state = 'queued',
          run_at = now() + make_interval(secs => :delay),   -- the backoff, on the database's clock
          dispatched_at = now(),                            -- the caller publishes right after commit
          claim_token = NULL, claimed_by = NULL, lease_expires_at = NULL
      WHERE id = :run_id AND claim_token = :token AND state = 'running'   -- fence
      RETURNING id, attempts
    )
    UPDATE job_run r SET outcome = 'retrying', finished_at = now(), error = CAST(:error AS jsonb)
    FROM settled s WHERE r.run_id = s.id AND r.outcome = 'running'   -- the open attempt
    RETURNING 1
    """
)


def settle_retry(conn: Connection, claim_: Claim, error_json: str, delay: float) -> bool:
    params = {"run_id": claim_.run_id, "token": claim_.token, "error": error_json, "delay": delay}
    return conn.execute(_SETTLE_RETRY, params).scalar() is not None


# The DLQ row copies what an operator needs to act after the run and event are
# purged. Shared by the two ways a run fails for good: a worker settling its last
# attempt, and the sweeper reclaiming a run whose last attempt lost its lease.
_DLQ_INSERT = """
    INSERT INTO job_run_dlq (run_id, workspace_id, function_id, event_id, event_name, event_data,
                             idempotency_key, failure, attempts, first_failed_at)
    SELECT f.id, f.workspace_id, f.job_id, f.event_id, f.event_name,
           coalesce(e.data, jsonb_build_object('scheduled_for', f.scheduled_for)),
           e.idempotency_key, f.failure, f.attempts,
           coalesce((SELECT min(r.finished_at) FROM job_run r
                     WHERE r.run_id = f.id AND r.outcome IN ('retrying', 'lost')), now())
    FROM failed f LEFT JOIN job_event e ON e.id = f.event_id
"""

_SETTLE_FAILED = text(
    """
    WITH failed AS (
      UPDATE job_queue
      SET state = 'failed', finished_at = now(), claim_token = NULL, lease_expires_at = NULL
      WHERE id = :run_id AND claim_token = :token AND state = 'running'   -- fence
      RETURNING id, workspace_id, job_id, event_id, event_name, scheduled_for, attempts,
                CAST(:error AS jsonb) AS failure
    ), ledger AS (
      UPDATE job_run r SET outcome = 'failed', finished_at = now(), error = CAST(:error AS jsonb)
      FROM failed f WHERE r.run_id = f.id AND r.outcome = 'running'
    ), dlq AS ("""
    + _DLQ_INSERT
    + """
      RETURNING id
    )
    -- one statement, one transaction: a failed run without its DLQ row (or the
    -- reverse) cannot exist, whatever crashes when.
    SELECT id FROM dlq
    """
)


def settle_failed(conn: Connection, claim_: Claim, error_json: str) -> uuid.UUID | None:
    """Mark the run failed and write its DLQ row; returns the DLQ id (None if fenced)."""
    return conn.execute(_SETTLE_FAILED, {"run_id": claim_.run_id, "token": claim_.token, "error": error_json}).scalar()


# --- sweep ----------------------------------------------------------------------

_RECLAIM_EXPIRED = text(
    """
    WITH expired AS (
      SELECT id FROM job_queue
      WHERE state = 'running'
        AND lease_expires_at < now()           -- the holder stopped renewing: died, hung or partitioned
      ORDER BY lease_expires_at                -- served by ix_job_queue_leases
      LIMIT :batch
      FOR UPDATE SKIP LOCKED                   -- a second sweeper takes other rows, never the same ones
    ), reclaimed AS (
      UPDATE job_queue q
      SET state = CASE WHEN q.attempts >= q.max_attempts THEN 'failed' ELSE 'queued' END,
          finished_at = CASE WHEN q.attempts >= q.max_attempts THEN now() END,
          run_at = now(), dispatched_at = now(),
          claim_token = NULL, claimed_by = NULL, lease_expires_at = NULL
      FROM expired x WHERE q.id = x.id
      RETURNING q.id, q.state, q.workspace_id, q.job_id, q.event_id, q.event_name, q.scheduled_for,
                q.attempts, jsonb_build_object('type', 'LeaseExpired', 'message',
                  'the worker stopped renewing its lease (killed, crashed or hung)') AS failure
    ), ledger AS (
      UPDATE job_run r SET outcome = 'lost', finished_at = now(), error = x.failure
      FROM reclaimed x WHERE r.run_id = x.id AND r.outcome = 'running'
    ), failed AS (
      SELECT * FROM reclaimed WHERE state = 'failed'
    ), dlq AS ("""
    + _DLQ_INSERT
    + """
    )
    SELECT id, job_id, state FROM reclaimed
    """
)


def reclaim_expired(conn: Connection, *, batch: int = 500) -> list[tuple[uuid.UUID, str, str]]:
    """Requeue (or fail into the DLQ) runs whose lease expired; returns (run_id, job_id, new_state)."""
    return [(r.id, r.job_id, r.state) for r in conn.execute(_RECLAIM_EXPIRED, {"batch": batch})]


_REPUBLISH_DUE = text(
    """
    WITH lost AS (
      SELECT id FROM job_queue
      WHERE state = 'queued'
        AND dispatched_at < now() - make_interval(secs => :after)  -- its last message is old: probably lost
        AND run_at <= now()                                         -- and it is due
      ORDER BY dispatched_at                                        -- oldest message first; ix_job_queue_stale
      LIMIT :batch                                                  -- a deep backlog is re-sent in slices, not flooded
      FOR UPDATE SKIP LOCKED
    )
    UPDATE job_queue q SET dispatched_at = now()
    FROM lost WHERE q.id = lost.id
    RETURNING q.id, q.job_id
    """
)


def republish_due(conn: Connection, *, after_seconds: float, batch: int = 500) -> list[tuple[uuid.UUID, str]]:
    """Runs due whose message is older than ``after_seconds``: publish each again after commit."""
    return [(r.id, r.job_id) for r in conn.execute(_REPUBLISH_DUE, {"after": after_seconds, "batch": batch})]


_TAKE_SWEEP_SLOT = text(
    """
    UPDATE job_sweep SET swept_at = now(), swept_by = :worker
    WHERE name = 'fleet'
      AND swept_at <= now() - make_interval(secs => :period)  -- nobody took this period yet; a
                                                              -- concurrent taker re-checks the new row and fails
    RETURNING swept_at
    """
)


def take_sweep_slot(conn: Connection, *, worker: str, period_seconds: float) -> bool:
    """Whether this sweeper does this period's sweep: true for the first caller per
    ``period_seconds`` fleet-wide; the others write nothing."""
    return conn.execute(_TAKE_SWEEP_SLOT, {"worker": worker, "period": period_seconds}).first() is not None


# --- cancel ---------------------------------------------------------------------

_CANCEL = text(
    """
    WITH cancelled AS (
      UPDATE job_queue
      SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL,
          wait_event = NULL
      WHERE id = :run_id
        AND state IN ('queued', 'running')     -- a finished run stays as it ended
      RETURNING id, attempts
    ), ledger AS (
      UPDATE job_run r SET outcome = 'cancelled', finished_at = now()
      FROM cancelled c WHERE r.run_id = c.id AND r.outcome = 'running'
    )
    SELECT count(*) FROM cancelled
    """
)


def cancel(conn: Connection, run_id: uuid.UUID) -> bool:
    """Cancel a queued or running run. A running one stops at its next step
    boundary: the claim token is cleared, so its next write is refused."""
    return bool(conn.execute(_CANCEL, {"run_id": run_id}).scalar())


# --- the worker's renewer --------------------------------------------------------


def renew_claims(conn: Connection, held: Sequence[tuple[uuid.UUID, uuid.UUID]], lease_seconds: float) -> set[uuid.UUID]:
    """``renew_leases`` by (run id, claim token) pairs, what a worker's renewer knows of a
    claim (core/leases.py); the run ids still held. The same statement, the same fence."""
    params = {"lease": lease_seconds, "run_ids": [run_id for run_id, _ in held], "tokens": [token for _, token in held]}
    return set(conn.execute(_RENEW_LEASES, params).scalars())
