"""Flow control's statements: throttle= decided at the claim, debounce= and batch= at send and at the claim.

Sent only for the runs of jobs that have one of those options (core/worker/flow.py, and the
producers' ``gather`` after an event's runs are written): every other run's claim, fan-out
and settle are the statements of worker.py and producer.py, unchanged. Each decision is one
transaction under the advisory lock of its key — ``motir.throttle:`` / ``motir.gather:`` +
job, workspace, key — taken in its own statement first, so every statement after it reads a
snapshot that includes the previous holder's commit. A worker killed mid-decision rolls the
whole decision back. Keys are per workspace; a job-wide throttle (key ``''``) spans them.
A run found by its id has its state checked as ``(state = 'queued') IS TRUE`` (worker.py says why),
and so do a key's queued runs: the key's indexes (``ix_job_queue_throttle_queued``,
``uq_job_queue_gathering_open``) are declared with that form, which proves their predicates
and no predicate of a state alone (``ix_job_queue_stale``, ``_due``: migration 0015).

``gather`` goes through ``motir_gather`` (migration 0012): the engine role to the writer,
the app role (a user's own transaction) to the checked function. Everything else here is
the engine role's.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.store.driver import Statement, first, rows

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

AUDIENCE = "flow"
ROLES = ("motir_engine", "motir_app")

FLOW_RUN = Statement(
    "flow_run",
    "What a flow decision about one run reads first: its state, flow columns, and its event's data (the keys).",
    """
    SELECT q.state, q.workspace_id, q.priority, q.flow_wait, q.flow_key, q.throttle_key,
           q.run_at <= now() AS due,                                        -- the claim's own test
           EXISTS (SELECT 1 FROM job_run r WHERE r.run_id = q.id) AS started,   -- ever claimed (ledger)
           q.parent_run_id IS NOT NULL AS child,                            -- step.invoke's: never gathered
           q.event_id, e.data AS event_data, q.scheduled_for
    FROM job_queue q LEFT JOIN job_event e ON e.id = q.event_id
    WHERE q.id = %(run_id)s
      AND q.job_id = %(job_id)s                -- a message for another job's run decides nothing
    """,
)


def flow_run(conn: Conn, run_id: uuid.UUID, job_id: str) -> dict[str, Any] | None:
    return first(conn, FLOW_RUN, {"run_id": run_id, "job_id": job_id})


LOCK_FLOW_KEY = Statement(
    "lock_flow_key",
    "Serialise the decisions of one flow-control key (throttle or gathering) until the transaction ends.",
    # The text is motir_write_gather's for 'gather': the senders and the claim share the lock.
    """
    SELECT pg_advisory_xact_lock(hashtextextended(
      'motir.' || %(kind)s || ':' || %(job_id)s || chr(31) || coalesce(%(workspace_id)s, '') || chr(31) || %(key)s,
      0)) AS locked
    """,
)


def lock_flow_key(conn: Conn, kind: str, job_id: str, workspace_id: str | None, key: str) -> None:
    """``kind``: ``throttle`` or ``gather``. ``workspace_id`` None for a key that spans workspaces."""
    rows(conn, LOCK_FLOW_KEY, {"kind": kind, "job_id": job_id, "workspace_id": workspace_id, "key": key})


GATHER = Statement(
    "gather",
    "debounce= / batch=: fold new runs into their key's open run, or open one (motir_gather, under the key's lock).",
    """
    SELECT run_id, into_run, due, due_in
    FROM motir_gather(CAST(%(run_ids)s AS uuid[]), CAST(%(kinds)s AS text[]), CAST(%(keys)s AS text[]),
                      CAST(%(waits)s AS float8[]), CAST(%(limits)s AS float8[]))
    """,
)


def gather(conn: Conn, runs: Sequence[tuple[uuid.UUID, str, str, float, float]]) -> list[dict[str, Any]]:
    """``runs``: (run id, kind, key, wait, limit). Per run gathered: the run that carries its event
    (``into_run``: itself when it opened the key's gathering), and whether that run is due now."""
    params = {"run_ids": [r[0] for r in runs], "kinds": [r[1] for r in runs], "keys": [r[2] for r in runs],
              "waits": [r[3] for r in runs], "limits": [r[4] for r in runs]}
    return rows(conn, GATHER, params)


CLOSE_GATHER = Statement(
    "close_gather",
    "The claim of a debounce / batch run ends its gathering, once due (under the key's lock, before the claim).",
    """
    UPDATE job_queue SET flow_wait = NULL
    WHERE id = %(run_id)s
      AND (flow_wait IN ('debounce', 'batch')) IS TRUE   -- still gathering
      AND (state = 'queued') IS TRUE                     -- not claimed (IS TRUE: found by id, worker.py's docstring)
      AND run_at <= now()                                -- quiet long enough / timed out (a sender may just have moved it)
    RETURNING id
    """,
)


def close_gather(conn: Conn, run_id: uuid.UUID) -> bool:
    return first(conn, CLOSE_GATHER, {"run_id": run_id}) is not None


SCHEDULE_EARLY = Statement(
    "schedule_early",
    "A flow run's message came before its run_at: mark that one message (or the sweep) is set for that instant.",
    """
    UPDATE job_queue
    SET dispatched_at = CASE
          -- a countdown message is sent now; the sweeper re-sends it republish_after late if lost
          WHEN run_at - now() <= make_interval(secs => %(after)s) THEN run_at
          -- too far off for a countdown: the sweeper publishes it once due
          ELSE run_at - make_interval(secs => %(after)s) END
    WHERE id = %(run_id)s
      AND (state = 'queued') IS TRUE AND run_at > now()                -- queued and not due yet
      AND dispatched_at < run_at - make_interval(secs => %(after)s)    -- nothing set for this run_at yet: once
    RETURNING extract(epoch FROM run_at - now()) AS due_in
    """,
)


def schedule_early(conn: Conn, run_id: uuid.UUID, republish_after: float) -> float | None:
    """Seconds until the run is due when this caller should send its countdown message; None when
    one is set already (an earlier message did it) or the sweeper will publish it."""
    row = first(conn, SCHEDULE_EARLY, {"run_id": run_id, "after": republish_after})
    if row is None:
        return None
    due_in = float(row["due_in"])
    return due_in if due_in <= republish_after else None


THROTTLE_STATE = Statement(
    "throttle_state",
    "throttle=: the decision's instant, the key's starts within the period (newest first), the runs waiting ahead.",
    """
    WITH t AS (SELECT statement_timestamp() AS at),   -- after the key's lock: later than the last holder's commit
    me AS (SELECT id, priority, created_at FROM job_queue WHERE id = %(run_id)s)
    SELECT t.at,
           ARRAY(SELECT s.throttle_at FROM job_queue s
                 WHERE s.job_id = %(job_id)s AND s.throttle_key = %(key)s           -- ix_job_queue_throttle_starts
                   AND (%(key)s = '' OR s.workspace_id IS NOT DISTINCT FROM %(workspace_id)s)   -- a key is per workspace
                   AND s.throttle_at > t.at - make_interval(secs => %(period)s)     -- within the period
                 ORDER BY s.throttle_at DESC LIMIT %(limit)s) AS recent,
           (SELECT count(*) FROM job_queue w, me
            WHERE w.job_id = %(job_id)s AND w.throttle_key = %(key)s               -- ix_job_queue_throttle_queued
              AND w.flow_wait = 'throttle' AND (w.state = 'queued') IS TRUE        -- waiting for a slot
              AND (%(key)s = '' OR w.workspace_id IS NOT DISTINCT FROM %(workspace_id)s)
              AND w.id <> me.id
              -- ahead of this run: higher priority, or as urgent and older
              AND (w.priority > me.priority
                   OR (w.priority = me.priority AND (w.created_at, w.id) < (me.created_at, me.id)))) AS ahead
    FROM t
    """,
)


def throttle_state(conn: Conn, run_id: uuid.UUID, job_id: str, key: str, workspace_id: str | None,
                   limit: int, period: float) -> dict[str, Any]:
    row = first(conn, THROTTLE_STATE, {"run_id": run_id, "job_id": job_id, "key": key,
                                       "workspace_id": workspace_id, "limit": limit, "period": period})
    assert row is not None
    return row


THROTTLE_ADMIT = Statement(
    "throttle_admit",
    "throttle=: record the start of a run this transaction just claimed (its key and the decision's instant).",
    """
    UPDATE job_queue SET throttle_key = %(key)s, throttle_at = %(at)s, flow_wait = NULL
    WHERE id = %(run_id)s
      AND claim_token = %(token)s              -- the claim made in this transaction
    RETURNING id
    """,
)


def throttle_admit(conn: Conn, run_id: uuid.UUID, token: uuid.UUID, key: str, at: datetime) -> bool:
    return first(conn, THROTTLE_ADMIT, {"run_id": run_id, "token": token, "key": key, "at": at}) is not None


THROTTLE_PARK = Statement(
    "throttle_park",
    "throttle=: a run with no start slot waits, queued, until its estimated turn (message or sweep set for it).",
    """
    UPDATE job_queue
    SET throttle_key = %(key)s, flow_wait = 'throttle',
        run_at = CAST(%(until)s AS timestamptz),
        -- its turn is near: the caller sends a countdown message; else the sweeper publishes it once due
        dispatched_at = CASE WHEN CAST(%(until)s AS timestamptz) - now() <= make_interval(secs => %(after)s)
                             THEN CAST(%(until)s AS timestamptz)
                             ELSE CAST(%(until)s AS timestamptz) - make_interval(secs => %(after)s) END
    WHERE id = %(run_id)s
      AND (state = 'queued') IS TRUE AND claim_token IS NULL   -- not claimed meanwhile (its duplicate waits on the same lock)
    RETURNING greatest(extract(epoch FROM run_at - now()), 0) AS due_in
    """,
)


def throttle_park(conn: Conn, run_id: uuid.UUID, key: str, until: datetime, republish_after: float) -> float | None:
    """Seconds until the parked run's turn; None when it was not queued any more."""
    row = first(conn, THROTTLE_PARK, {"run_id": run_id, "key": key, "until": until, "after": republish_after})
    return None if row is None else float(row["due_in"])


BATCH_EVENTS = Statement(
    "batch_events",
    "batch=: the events a run gathered, in order of arrival (its handler's list).",
    """
    SELECT e.id, e.name, e.data, e.workspace_id
    FROM job_batch_item b JOIN job_event e ON e.id = b.event_id
    WHERE b.run_id = %(run_id)s                -- pk_job_batch_item, run_id leading
    ORDER BY b.position
    """,
)


def batch_events(conn: Conn, run_id: uuid.UUID) -> list[dict[str, Any]]:
    return rows(conn, BATCH_EVENTS, {"run_id": run_id})
