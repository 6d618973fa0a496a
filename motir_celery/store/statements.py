"""The queue repository: every hot statement of the engine, written out plainly.

Each function is one round trip. Claim, step write and settle are the hot path
(a run of k new steps costs k + 1 statements and k + 1 commits: the last step
rides in the settle); enqueue and sweep are the rest. Rules that hold for
every statement here:

* **The database decides.** "Already done?" is a unique constraint
  (``ON CONFLICT DO NOTHING``) or a conditional ``UPDATE``, never a read then a
  write. A conflict comes back as an ordinary value, not an exception.
* **Fenced.** Every write a worker makes on a run it holds is conditional on
  ``claim_token``; a worker whose lease was reclaimed writes nothing.
* **One clock.** "Due", "expired" and every stored instant use the database's
  ``now()``; Python only ever binds *durations* (lease length, backoff),
  never an instant read from its own clock.

Functions take a ``Connection`` and leave the transaction to the caller: the
runner commits each statement on its own, ``send_event(session=...)`` writes
inside the caller's transaction.

The three statements every run executes (claim, step write, settle) skip
SQLAlchemy's execution layer and go to the psycopg connection underneath as
prepared statements: Core costs ~50-70 us of CPU per statement for
compile-cache lookup and result wrapping, a fifth of a short run's CPU
(docs/performance.md). They keep ``%(name)s`` placeholders and the same
transaction and error semantics as the rest. The claim waits for its answer
(``driver.hot``); the step writes and a success's settle are sent through ``driver.Pipe``
(libpq's pipeline mode) and answered later, so a run waits for two answers
however many steps it stores (steps.py says when they are read).
``record_event`` is one statement too (the function ``motir_record_event``,
migration 0004): at low load an idle client and server pay for every
statement in wake-ups, not in work.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Sequence

from sqlalchemy import Connection, text

from motir_celery.store.driver import Pipe, Prepared, hot, hot_rows
from motir_celery.core.runspec import RunSpec

__all__ = [
    "Claim",
    "Queued",
    "AlreadyQueued",
    "OverlapSkipped",
    "record_event",
    "fan_out",
    "enqueue_scheduled",
    "claim",
    "store_step",
    "store_steps",
    "send_store_steps",
    "renew_lease",
    "settle_succeeded",
    "settle_retry",
    "settle_failed",
    "reclaim_expired",
    "republish_due",
    "cancel",
]


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
    #: driver.Pipe's statements prepared on the claim's connection (names).
    prepared: tuple[str, ...] = ()


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
_RECORD_EVENT = (  # psycopg placeholders: see driver.hot
    """
    SELECT * FROM motir_record_event(
      %(name)s, CAST(%(data)s AS jsonb), %(workspace_id)s, %(key)s, %(traceparent)s,
      CAST(%(job_ids)s AS text[]), CAST(%(max_attempts)s AS int[]), CAST(%(policies)s AS text[]),
      CAST(%(priorities)s AS smallint[]), CAST(%(singletons)s AS text[]), CAST(%(concurrency)s AS text[]),
      CAST(%(cancel_keys)s AS text[]))
    """
)


def _specs(specs: Sequence[RunSpec], traceparent: str | None) -> dict[str, Any]:
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


def _runs(specs: Sequence[RunSpec], rows: Sequence[tuple[Any, ...]]) -> list[Queued | AlreadyQueued]:
    created = {job_id: run_id for run_id, job_id in rows if run_id is not None}
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
              **_specs(specs, traceparent)}
    rows = hot_rows(conn, _RECORD_EVENT, params)
    recorded = [(event_id, run_id, job_id) for woken, event_id, run_id, job_id in rows if not woken]
    if not recorded:
        return None, [], []
    woken_runs = [Queued(run_id, job_id) for woken, _, run_id, job_id in rows if woken]
    return recorded[0][0], _runs(specs, [(run_id, job_id) for _, run_id, job_id in recorded]), woken_runs


_FAN_OUT = (  # psycopg placeholders: see driver.hot
    "WITH e AS (SELECT id, name, workspace_id FROM job_event WHERE id = %(event_id)s), runs AS ("
    + _RUNS_OF_E
    + ") SELECT id, job_id FROM runs"
)


def fan_out(
    conn: Connection, event_id: uuid.UUID, specs: Sequence[RunSpec], *, traceparent: str | None = None
) -> list[Queued | AlreadyQueued]:
    """One run per spec for a recorded event, deduplicated by the database."""
    if not specs:
        return []
    rows = hot_rows(conn, _FAN_OUT, {"event_id": event_id, **_specs(specs, traceparent)})
    return _runs(specs, rows)


_CANCEL_BY_KEY = text(
    """
    WITH cancelled AS (
      UPDATE job_queue
      SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL,
          wait_event = NULL
      WHERE job_id = :job_id
        AND cancel_key = :key                                   -- the cancel_on rule's field matched
        AND state IN ('queued', 'running')                      -- a finished run stays as it ended
        AND (CAST(:within AS float8) IS NULL
             OR created_at > now() - make_interval(secs => CAST(:within AS float8)))   -- the rule's timeout
      RETURNING id
    ), ledger AS (
      UPDATE job_run r SET outcome = 'cancelled', finished_at = now()
      FROM cancelled c WHERE r.run_id = c.id AND r.outcome = 'running'
    )
    SELECT id FROM cancelled
    """
)


def cancel_by_key(conn: Connection, job_id: str, key: str, within_seconds: float | None) -> list[uuid.UUID]:
    """cancel_on: cancel the job's active runs whose triggering event carried ``key``."""
    return list(conn.execute(_CANCEL_BY_KEY, {"job_id": job_id, "key": key, "within": within_seconds}).scalars())


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


# --- claim ------------------------------------------------------------------------

_CLAIM = (  # psycopg placeholders: see driver.hot
    """
    WITH claimed AS (
      UPDATE job_queue
      SET state = 'running',
          attempts = attempts + 1,             -- charged now: a run that kills its worker still spends attempts
          claim_token = gen_random_uuid(),     -- fences every later write to this holder
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
                   AND r.state = 'running') < CAST(%(limit)s AS int))
      RETURNING id, job_id, claim_token, attempts, max_attempts, workspace_id, event_id, event_name, scheduled_for,
                concurrency_key, traceparent
    ), ledger AS (
      INSERT INTO job_run (run_id, attempt, workspace_id, job_id, event_name, worker)
      SELECT id, attempts, workspace_id, job_id, event_name, %(worker)s FROM claimed
    )
    SELECT c.id, c.job_id, c.claim_token, c.attempts, c.max_attempts, c.workspace_id, c.event_id, c.event_name,
           e.data, c.scheduled_for,
           -- memoized steps in the same round trip (snapshot taken before this claim: prior attempts' steps)
           (SELECT coalesce(jsonb_object_agg(s.step_id, s.output), '{}'::jsonb)
              FROM job_step s WHERE s.run_id = c.id),
           now(), c.concurrency_key, c.traceparent,
           -- Which statements of driver.Pipe this session has prepared: psycopg deallocates
           -- every prepared statement of a connection after a ROLLBACK or a DROP on it.
           (SELECT coalesce(array_agg(name), '{}') FROM pg_prepared_statements WHERE name LIKE 'motir\\_%%'),
           -- The claim's commit does not wait for the WAL flush: losing it to a
           -- crash of Postgres loses no work (the run is queued again, attempt
           -- uncharged), and the run's first flushed write — a step or the
           -- settle, later in the same WAL — makes it durable. REJECTED: an
           -- option for it; there is nothing to trade.
           set_config('synchronous_commit', 'off', true)
    FROM claimed c LEFT JOIN job_event e ON e.id = c.event_id
    """
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
          concurrency_limit: int | None = None) -> Claim | None:
    """Move a queued, due run to running for this worker; ``None`` if it is not ours to run."""
    row = hot(conn, _CLAIM, {"run_id": run_id, "job_id": job_id, "worker": worker, "lease": lease_seconds,
                              "limit": concurrency_limit})
    if row is None:
        return None
    return Claim(*row[:-1])  # the SELECT list is Claim's fields, in order (and the set_config)


_NEXT_IN_LINE = text(
    """
    WITH next AS (
      SELECT id FROM job_queue
      WHERE job_id = :job_id AND concurrency_key = :key
        AND state = 'queued' AND run_at <= now()   -- waiting for a slot, due
      ORDER BY priority DESC, run_at               -- priority decides who gets a freed slot
      LIMIT 1
      FOR UPDATE SKIP LOCKED
    )
    UPDATE job_queue q SET dispatched_at = now() FROM next WHERE q.id = next.id
    RETURNING q.id
    """
)


def next_in_line(conn: Connection, job_id: str, key: str) -> uuid.UUID | None:
    """The queued run that should take a concurrency slot just freed (publish it after commit)."""
    return conn.execute(_NEXT_IN_LINE, {"job_id": job_id, "key": key}).scalar()


# --- step write and heartbeat --------------------------------------------------------

# The held steps of %(steps)s (steps_json) inserted for the run row r (id,
# workspace_id, attempts) of a CTE named by the caller: the tail of both
# _STORE_STEPS and _SETTLE_SUCCEEDED.
_STEPS_OF_R = """
      INSERT INTO job_step (run_id, step_id, workspace_id, output, attempt, started_at)
      -- x -> 'output', not jsonb_to_recordset: that turns a step's JSON null into SQL NULL.
      SELECT r.id, x ->> 'id', r.workspace_id, x -> 'output', r.attempts,
             now() - make_interval(secs => CAST(x ->> 'elapsed' AS float8))
      FROM {r} r, jsonb_array_elements(CAST(%(steps)s AS jsonb)) AS x
      ON CONFLICT (run_id, step_id) DO NOTHING   -- already stored (a racing duplicate): the stored value wins
"""

_STORE_STEPS = (  # psycopg placeholders: see driver.hot
    """
    WITH run AS (
      SELECT id, workspace_id, attempts FROM job_queue
      WHERE id = %(run_id)s
        AND claim_token = %(token)s            -- fence: only the current holder writes
        AND state = 'running'                  -- a cancelled run stops at its next step boundary
        -- Opt-in (MOTIR_ASYNC_STEP_COMMIT, off by default): this transaction's commit
        -- does not wait for the WAL flush. Set inside the statement, so it costs no
        -- round trip and touches no other transaction; CASE keeps it unevaluated when off.
        AND CASE WHEN %(async_commit)s THEN set_config('synchronous_commit', 'off', true) IS NOT NULL
                 ELSE true END
      -- FOR SHARE: a concurrent reclaim or cancel waits for these inserts to commit, or
      -- this statement re-checks the fence against the reclaimed row and writes nothing.
      FOR SHARE
    ), stored AS ("""
    + _STEPS_OF_R.replace("{r}", "run")
    + """
      RETURNING 1
    )
    SELECT count(*) FROM stored
    """
)


_STORE_STEPS_PIPED = Prepared.of("motir_store_steps", _STORE_STEPS)

#: A finished step not stored yet: (key, output JSON, seconds since its body began).
Finished = tuple[str, str, float]


def steps_json(steps: Sequence[Finished]) -> str:
    """Finished steps as one JSON array of {"id", "output", "elapsed"}. Each output is
    JSON already (steps.encode_json), so it is spliced in, not encoded again."""
    return "[" + ",".join(f'{{"id":{json.dumps(key)},"output":{output},"elapsed":{elapsed!r}}}'
                          for key, output, elapsed in steps) + "]"


def _steps_params(claim_: Claim, steps: Sequence[Finished], async_commit: bool) -> dict[str, Any]:
    return {"run_id": claim_.run_id, "token": claim_.token, "steps": steps_json(steps),
            "async_commit": async_commit}


def send_store_steps(pipe: Pipe, claim_: Claim, steps: Sequence[Finished], tag: Any, *,
                     async_commit: bool = False) -> None:
    """store_steps without waiting: its answer (one row, the count stored) comes
    from ``pipe.answers``, tagged ``tag``."""
    pipe.send(_STORE_STEPS_PIPED, _steps_params(claim_, steps, async_commit), tag)


def store_steps(conn: Connection, claim_: Claim, steps: Sequence[Finished], *, async_commit: bool = False) -> int:
    """Store finished steps in one statement and commit; how many were stored: all
    of them, or 0 when the fence refused them (lost claim or cancelled), or fewer
    when some were stored already.

    ``async_commit``: commit without waiting for the WAL flush. The records are
    visible and fenced at once; only a crash of Postgres itself within the
    flush delay (``wal_writer_delay``, 200 ms by default) can lose them, and a lost
    record only runs its step again (as does every later, equally lost one).
    """
    row = hot(conn, _STORE_STEPS, _steps_params(claim_, steps, async_commit))
    return int(row[0]) if row is not None else 0


def store_step(conn: Connection, claim_: Claim, step_id: str, output_json: str, elapsed: float) -> bool:
    """One step's ``store_steps``; ``False`` when the fence refused it."""
    return store_steps(conn, claim_, [(step_id, output_json, elapsed)]) == 1


_RENEW_LEASE = text(
    """
    UPDATE job_queue SET lease_expires_at = now() + make_interval(secs => :lease)
    WHERE id = :run_id AND claim_token = :token AND state = 'running'   -- fence
    RETURNING 1
    """
)


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
_FIND_EVENT = text(
    """
    SELECT id, name, data, received_at FROM job_event
    WHERE name = :name
      AND data #>> CAST(:path AS text[]) = :value   -- the waiter's field, as text
      AND received_at >= :since                     -- only events since the wait began
    ORDER BY received_at
    LIMIT 1
    """
)


def lock_wait(conn: Connection, name: str) -> None:
    """Exclusive twin of record_event's shared lock: after it, every event of ``name``
    committed so far is visible, and every later one will see this transaction's waiter."""
    conn.execute(_LOCK_WAIT, {"name": name})


def find_event(conn: Connection, name: str, path: list[str], value: str | None, since: datetime) -> Any:
    if value is None:
        return None
    return conn.execute(_FIND_EVENT, {"name": name, "path": path, "value": value, "since": since}).one_or_none()


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

_SETTLE_SUCCEEDED = (  # psycopg placeholders: see driver.hot
    """
    WITH settled AS (
      UPDATE job_queue
      SET state = 'succeeded', result = CAST(%(result)s AS jsonb), finished_at = now(),
          claim_token = NULL, lease_expires_at = NULL
      WHERE id = %(run_id)s AND claim_token = %(token)s AND state = 'running'   -- fence
      RETURNING id, attempts, workspace_id
    ), held AS (
      -- The handler's finished steps not stored yet (steps.Step), the last one at
      -- least: stored in this commit, and only if the fenced settle above took the row.
      """
    + _STEPS_OF_R.replace("{r}", "settled")
    + """
    )
    UPDATE job_run r SET outcome = 'succeeded', finished_at = now()
    FROM settled s WHERE r.run_id = s.id AND r.outcome = 'running'   -- the open attempt
    RETURNING 1
    """
)


def settle_succeeded(conn: Connection, claim_: Claim, result_json: str, steps: Sequence[Finished] = ()) -> bool:
    """Settle a run that succeeded, storing ``steps`` (finished, not stored yet)
    in the same statement and commit."""
    return hot(conn, _SETTLE_SUCCEEDED, _settle_params(claim_, result_json, steps)) is not None


def _settle_params(claim_: Claim, result_json: str, steps: Sequence[Finished]) -> dict[str, Any]:
    return {"run_id": claim_.run_id, "token": claim_.token, "result": result_json, "steps": steps_json(steps)}


_SETTLE_SUCCEEDED_PIPED = Prepared.of("motir_settle_succeeded", _SETTLE_SUCCEEDED)


def send_settle_succeeded(pipe: Pipe, claim_: Claim, result_json: str, steps: Sequence[Finished], tag: Any) -> None:
    """settle_succeeded without waiting, behind the step writes still in flight."""
    pipe.send(_SETTLE_SUCCEEDED_PIPED, _settle_params(claim_, result_json, steps), tag)


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
    return (
        conn.execute(
            _SETTLE_RETRY, {"run_id": claim_.run_id, "token": claim_.token, "error": error_json, "delay": delay}
        ).scalar()
        is not None
    )


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
    return [tuple(r) for r in conn.execute(_RECLAIM_EXPIRED, {"batch": batch})]  # type: ignore[misc]


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
    return [tuple(r) for r in conn.execute(_REPUBLISH_DUE, {"after": after_seconds, "batch": batch})]  # type: ignore[misc]


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
