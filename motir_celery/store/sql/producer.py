"""The producer's statements: events, batches, direct runs, cron slots, and the reads behind a result handle.

What ``send_event`` / ``send_events`` / ``job.delay()`` / the beat write, and what a
``RunHandle`` reads. Every write is one statement (its own transaction in
autocommit); the event writers are the functions of migration 0008, which the
engine role reaches through the dispatchers (``motir_record_event``,
``motir_record_events``, ``motir_direct_run``) and the app role through the
checked functions behind them: a user's own transaction (``session=``, Django's
``atomic()``) may hold either. Keys are per workspace, and so is every lookup
here: each names the workspace it answers for.

Functions take a ``Connection`` and leave the transaction to the caller.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.store.driver import Statement, first, rows
from motir_celery.store.records import AlreadyQueued, OverlapSkipped, Queued, RunSpec

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

AUDIENCE = "producer"
ROLES = ("motir_engine", "motir_app")

# --- events -----------------------------------------------------------------------------

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
    conn: Conn, name: str, data_json: str, workspace_id: str | None, idempotency_key: str | None,
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


def existing_event(conn: Conn, name: str, data_json: str, workspace_id: str | None,
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
    conn: Conn, event_id: uuid.UUID, specs: Sequence[RunSpec], *, traceparent: str | None = None
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
        AND cancel_key = %(key)s                                -- the cancel_on rule's field matched (ix_job_queue_cancel_active)
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



def cancel_by_key(conn: Conn, job_id: str, key: str, within_seconds: float | None,
                  workspace_id: str | None) -> list[uuid.UUID]:
    """cancel_on: cancel the job's active runs in ``workspace_id`` whose triggering event carried ``key``."""
    params = {"job_id": job_id, "key": key, "within": within_seconds, "workspace_id": workspace_id}
    return [r["id"] for r in rows(conn, CANCEL_BY_KEY, params)]


EVENT_OF = Statement(
    "event_of",
    "A recorded event's name, data and workspace (dispatch_event fans it out again).",
    "SELECT name, data, workspace_id FROM job_event WHERE id = %(id)s",
)


def event_of(conn: Conn, event_id: uuid.UUID) -> dict[str, Any] | None:
    return first(conn, EVENT_OF, {"id": event_id})


# --- cron slots (the beat) --------------------------------------------------------------

ENQUEUE_SCHEDULED = Statement(
    "enqueue_scheduled",
    "The run of one cron slot, once per (job, slot) however many beats tick it.",
    """
    INSERT INTO job_queue (job_id, scheduled_for, event_name, workspace_id, max_attempts, retry_policy,
                           priority, concurrency_key)
    -- scheduled_for is bound from Python, and that is safe: it is a cron slot
    -- computed from (expression, zone, the database's now()), not a reading of
    -- this process's clock, so every beat binds the same instant for one slot.
    VALUES (%(job_id)s, %(scheduled_for)s, %(event_name)s, NULL, %(max_attempts)s, %(policy)s, %(priority)s,
            %(concurrency_key)s)
    -- one run per (job, slot), however many beats tick it.
    ON CONFLICT (job_id, scheduled_for) DO NOTHING
    RETURNING id
    """,
)

# overlap="skip". The decision is the database's, inside the INSERT: the row is
# inserted with skip_overlap = true, so uq_job_queue_skip_overlap_active (one
# queued-or-running skip_overlap row per job) refuses it while another run of
# the job is active. Unlike `INSERT … WHERE NOT EXISTS (active run)`, which two
# transactions under READ COMMITTED can both pass before either commits, a
# unique index makes the second inserter wait for the first and then conflict
# (or proceed if the first rolled back), at any isolation level. Not an
# advisory lock + check, which is only as safe as every writer remembering the
# lock, and is broken under REPEATABLE READ (the check's snapshot predates the
# wait). No conflict target: both arbiters apply — (job_id, scheduled_for) says
# "this slot exists", the partial index says "a run is active".
ENQUEUE_SCHEDULED_SKIPPING = Statement(
    "enqueue_scheduled_skipping",
    "The run of one cron slot of an overlap=\"skip\" job, refused while another run of the job is active.",
    """
    INSERT INTO job_queue (job_id, scheduled_for, event_name, workspace_id, max_attempts, retry_policy,
                           priority, concurrency_key, skip_overlap)
    VALUES (%(job_id)s, %(scheduled_for)s, %(event_name)s, NULL, %(max_attempts)s, %(policy)s, %(priority)s,
            %(concurrency_key)s, true)
    ON CONFLICT DO NOTHING
    RETURNING id
    """,
)

# The slot was refused. If the slot itself exists, this conflicts too
# (AlreadyQueued); otherwise the active run blocked it, and the skip is written
# down as a finished row for the slot, so a beat arriving later (after the
# blocking run ended) finds the slot taken instead of running it late.
RECORD_SKIP = Statement(
    "record_skip",
    "Write down a skipped overlap=\"skip\" slot as a cancelled row, naming the run that blocked it.",
    """
    INSERT INTO job_queue (job_id, scheduled_for, event_name, workspace_id, max_attempts, retry_policy,
                           skip_overlap, state, finished_at, result)
    VALUES (%(job_id)s, %(scheduled_for)s, %(event_name)s, NULL, %(max_attempts)s, %(policy)s,
            true, 'cancelled', now(),
            jsonb_build_object('skipped', 'overlap', 'blocking_run_id',
              (SELECT id FROM job_queue       -- served by the partial index; NULL if it just ended
               WHERE job_id = %(job_id)s AND skip_overlap AND state IN ('queued', 'running') LIMIT 1)))
    ON CONFLICT (job_id, scheduled_for) DO NOTHING
    RETURNING id, result ->> 'blocking_run_id' AS blocking
    """,
)


def enqueue_scheduled(
    conn: Conn, job_id: str, scheduled_for: datetime, *, max_attempts: int, policy: str,
    priority: int = 0, concurrency_key: str | None = None, skip_overlap: bool = False,
) -> Queued | AlreadyQueued:
    """The run of one cron slot: ``Queued``, ``AlreadyQueued`` or (skip_overlap) ``OverlapSkipped``."""
    if scheduled_for.tzinfo is None:
        raise ValueError("scheduled_for must be timezone-aware")
    params = {"job_id": job_id, "scheduled_for": scheduled_for, "event_name": f"scheduled.{job_id}",
              "max_attempts": max_attempts, "policy": policy, "priority": priority,
              "concurrency_key": concurrency_key}
    if not skip_overlap:
        row = first(conn, ENQUEUE_SCHEDULED, params)
        return Queued(row["id"], job_id) if row is not None else AlreadyQueued(job_id)
    row = first(conn, ENQUEUE_SCHEDULED_SKIPPING, params)
    if row is not None:
        return Queued(row["id"], job_id)
    skipped = first(conn, RECORD_SKIP, params)
    if skipped is None:
        return AlreadyQueued(job_id)
    blocking = uuid.UUID(skipped["blocking"]) if skipped["blocking"] else None
    return OverlapSkipped(job_id, skipped["id"], blocking)


DB_NOW = Statement(
    "db_now",
    "The database's now(): the beat computes due cron slots from it, never from its own clock.",
    "SELECT now() AS now",
)


def db_now(conn: Conn) -> datetime:
    row = first(conn, DB_NOW, {})
    assert row is not None
    now: datetime = row["now"]
    return now


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

DIRECT_RUN_EXISTING = Statement(
    "direct_run_existing",
    "The run a refused direct run stands for: the one its idempotency key made, or the active run of its singleton key.",
    """
    -- same arguments, or a key with two meanings. A Celery task's message fields (under "celery") are not its
    -- arguments (a redelivered copy adopted by a worker has its root filled in); but the call they name, when
    -- this one names one, must be the same: a frozen signature sent again is another call (adapter/tasks.py)
    (SELECT q.id AS run_id, (e.data - 'celery') = (CAST(%(data)s AS jsonb) - 'celery')
              AND (CAST(%(data)s AS jsonb) #> '{celery,call}' IS NULL
                   OR e.data #> '{celery,call}' IS NOT DISTINCT FROM CAST(%(data)s AS jsonb) #> '{celery,call}') AS same
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

#: What RUN_RESULT (and adapter.RUN_META) read about one run ``q``: its latest attempt's outcome
#: and error, its latest progress report, and for a run that failed without any attempt (a message refused at adoption,
#: adapter.ADOPT_REFUSED) the failure its DLQ row holds.
RESULT_OF_RUN = """
    SELECT q.id, q.job_id, q.state, q.result, q.attempts, q.finished_at, q.workspace_id,
           r.outcome AS last_outcome,
           coalesce(r.error, CASE WHEN q.state = 'failed' THEN
             (SELECT d.failure FROM job_run_dlq d WHERE d.run_id = q.id) END) AS last_error,   -- uq (run_id)
           -- the latest progress report (step.progress, update_state) and the attempt that made it
           p.state AS progress_state, p.meta AS progress_meta, p.attempt AS progress_attempt
    FROM job_queue q
    LEFT JOIN job_progress p ON p.run_id = q.id   -- its primary key
    LEFT JOIN LATERAL (
      SELECT outcome, error FROM job_run
      WHERE run_id = q.id                      -- this run's ledger (ix_job_run_ledger)
      ORDER BY started_at DESC LIMIT 1         -- its latest attempt: retrying, failed, lost...
    ) r ON true
    WHERE q.id = %(run_id)s"""

RUN_RESULT = Statement(
    "run_result",
    "A run's state, result and how its latest attempt ended, in the caller's workspace (the result handle's .state and .get).",
    RESULT_OF_RUN + """
      AND q.workspace_id IS NOT DISTINCT FROM %(workspace_id)s   -- another workspace's run is not found
    """,
)



# --- batches (send_events) -----------------------------------------------------------

RECORD_EVENTS = Statement(
    "record_events",
    "Write N events, their runs, and wake the runs waiting for them (one statement: motir_record_events).",
    """
    SELECT * FROM motir_record_events(
      CAST(%(names)s AS text[]), CAST(%(datas)s AS jsonb[]), CAST(%(workspace_ids)s AS text[]),
      CAST(%(keys)s AS text[]), %(traceparent)s,
      CAST(%(run_events)s AS int[]), CAST(%(job_ids)s AS text[]), CAST(%(max_attempts)s AS int[]),
      CAST(%(policies)s AS text[]), CAST(%(priorities)s AS smallint[]), CAST(%(singletons)s AS text[]),
      CAST(%(concurrency)s AS text[]), CAST(%(cancel_keys)s AS text[]))
    """,
)


def record_events(conn: Conn, events: Sequence[tuple[str, str, str | None, str | None]],
                  specs: Sequence[Sequence[RunSpec]], *, traceparent: str | None) -> list[dict[str, Any]]:
    """``events``: (name, data as JSON, workspace, key); ``specs[i]``: the runs of event i.
    Rows: (woken, idx 1-based, event_id, run_id, job_id); an event deduplicated by its key has none."""
    flat = [(i + 1, s) for i, ss in enumerate(specs) for s in ss]
    params = {
        "names": [e[0] for e in events], "datas": [e[1] for e in events],
        "workspace_ids": [e[2] for e in events], "keys": [e[3] for e in events], "traceparent": traceparent,
        "run_events": [i for i, _ in flat], "job_ids": [s.job_id for _, s in flat],
        "max_attempts": [s.max_attempts for _, s in flat], "policies": [s.policy for _, s in flat],
        "priorities": [s.priority for _, s in flat], "singletons": [s.singleton_key for _, s in flat],
        "concurrency": [s.concurrency_key for _, s in flat], "cancel_keys": [s.cancel_key for _, s in flat],
    }
    return rows(conn, RECORD_EVENTS, params)


EXISTING_EVENTS = Statement(
    "existing_events",
    "What the idempotency keys of deduplicated events already stand for in their workspaces (same data, or not).",
    """
    SELECT k.i, e.id, e.data = k.data AS same
    FROM unnest(CAST(%(names)s AS text[]), CAST(%(keys)s AS text[]), CAST(%(datas)s AS jsonb[]),
                CAST(%(workspace_ids)s AS text[])) WITH ORDINALITY AS k(name, key, data, workspace_id, i)
    JOIN job_event e ON e.name = k.name AND e.idempotency_key = k.key   -- the key's event (uq_job_event_idempotency)
                    AND e.workspace_id IS NOT DISTINCT FROM k.workspace_id   -- keys are per workspace
    """,
)


def existing_events(conn: Conn, events: Sequence[tuple[str, str, str | None, str | None]]) -> list[dict[str, Any]]:
    params = {"names": [e[0] for e in events], "datas": [e[1] for e in events],
              "workspace_ids": [e[2] for e in events], "keys": [e[3] for e in events]}
    return rows(conn, EXISTING_EVENTS, params)
