"""The worker's statements, from message to settle: claim, step records, leases, waits, children, settles.

A run of k new steps costs k + 2 statements, each its own transaction on the
runner's autocommit connection: the claim, one fenced write per step (committed
before the next body starts), the settle. Rules that hold for every statement here:

* **The database decides.** "Already done?" is a unique constraint
  (``ON CONFLICT DO NOTHING``) or a conditional ``UPDATE``, never a read then a
  write. A conflict comes back as an ordinary value, not an exception.
* **Fenced.** Every write a worker makes on a run it holds is conditional on
  ``claim_token``; a worker whose lease was reclaimed writes nothing.
* **One clock.** "Due", "expired" and every stored instant use the database's
  ``now()``; Python only ever binds *durations* (lease length, backoff).
* **Found by id, through the primary key.** A statement that finds a run by its id
  writes its state check as ``(state = 'queued') IS TRUE`` (the same test: ``state``
  is never NULL), so the planner cannot prove a partial index's predicate from it.
  Written ``state = 'queued'``, it may read the run through ``ix_job_queue_stale`` or
  ``_due`` (``_leases`` for ``'running'``): with statistics taken while nothing was
  queued, those cost ~0 rows, and each claim scanned every queued run for its own
  (1,700 index entries a claim in a drain of 3,000), each step record, settle and
  lease renewal every running one (tests/store/test_schema.py). A parent found by id
  checks ``(wait_event = 'motir.children') IS TRUE`` for the same reason
  (``ix_job_queue_waiting``: every suspended parent), and a run checked for its flow
  control ``(flow_wait IN (...)) IS TRUE``: the key indexes below are declared on
  ``(state = 'queued') IS TRUE``, which a lookup by id would prove otherwise.
* **Found by key, through the key's index.** A lookup of a key's queued runs
  (``next_in_line`` here, flow control's in flow.py) checks ``(state = 'queued') IS TRUE``,
  as its index is declared (migrations 0015, 0016): that form proves the key index's
  predicate and no predicate of a state alone.

Run by the engine role. Functions take a ``Connection`` and leave the transaction
to the caller.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.store.driver import Statement, first, rows
from motir_celery.store.records import Claim, RunSpec

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

AUDIENCE = "worker"
ROLES = ("motir_engine",)

#: The wait_event of a parent suspended until its children settle (the trigger
#: motir_run_settled matches it). No event is ever sent under this name with a
#: wait_value, so send_event never wakes such a parent.
CHILD_WAIT = "motir.children"

# --- claim ------------------------------------------------------------------------

CLAIM = Statement(
    "claim",
    "Move a queued, due run to running for one worker; its event and memoized steps in the same round trip.",
    """
    WITH claimed AS (
      UPDATE job_queue
      SET state = 'running',
          attempts = attempts + 1,             -- charged now: a run that kills its worker still spends attempts
          -- fences every later write to this holder; minted by the holder (its lease renewer
          -- knows it before the claim commits: core/worker/leases.py) or here
          claim_token = coalesce(CAST(%(token)s AS uuid), gen_random_uuid()),
          claimed_by = %(worker)s,
          lease_expires_at = now() + make_interval(secs => %(lease)s),
          wait_event = NULL, wait_path = NULL, wait_value = NULL   -- a woken waiter waits no more
      WHERE id = %(run_id)s
        AND job_id = %(job_id)s                -- a message for another job's run (misrouted, forged) claims nothing
        AND (state = 'queued') IS TRUE         -- running: someone holds it; final: done. Either way a stale message.
        AND run_at <= now()                    -- not due yet (backoff): the sweeper publishes it again when it is
        AND dispatched_at < 'infinity'         -- held by admission (core/admission.py): a stale duplicate message;
                                               -- the dispatcher sends it again when it is its turn
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
           -- async_commit (the engine's, on: docs/reliability.md): this commit does not wait for
           -- the WAL flush. Hazard: a crash of Postgres itself may lose the claim; the run is
           -- then queued again with the attempt uncharged, and no step is lost, because
           -- every step record and settle after it is a flushed commit later in the WAL.
           CASE WHEN %(async_commit)s THEN set_config('synchronous_commit', 'off', true) END AS async_commit
    FROM claimed c LEFT JOIN job_event e ON e.id = c.event_id
    """,
)


def claim(conn: Conn, run_id: uuid.UUID, *, job_id: str, worker: str, lease_seconds: float,
          async_commit: bool, concurrency_limit: int | None = None, token: uuid.UUID | None = None) -> Claim | None:
    """Move a queued, due run to running for this worker; ``None`` if it is not ours to run."""
    row = first(conn, CLAIM, {"run_id": run_id, "job_id": job_id, "worker": worker, "lease": lease_seconds,
                              "limit": concurrency_limit, "async_commit": async_commit, "token": token})
    if row is None:
        return None
    del row["async_commit"]
    return Claim(**row)


LOCK_CONCURRENCY = Statement(
    "lock_concurrency",
    "Serialise the claims of one (job, concurrency key) until the transaction ends (jobs with concurrency= only).",
    """
    SELECT pg_advisory_xact_lock(hashtextextended(job_id || chr(31) || concurrency_key, 0)) AS locked
    FROM job_queue
    WHERE id = %(run_id)s
      AND concurrency_key IS NOT NULL          -- a run without a key takes no lock
    """,
)


def lock_concurrency(conn: Conn, run_id: uuid.UUID) -> None:
    """Serialise claims of one (job, concurrency key) until this transaction ends, so
    two workers cannot both count the last free slot (cold path: jobs with concurrency=).
    The lock spans workspaces (coarser than the count, so never wrong)."""
    rows(conn, LOCK_CONCURRENCY, {"run_id": run_id})


NEXT_IN_LINE = Statement(
    "next_in_line",
    "The queued, due run that takes a concurrency slot just freed (its message is sent after commit).",
    """
    WITH next AS (
      SELECT id FROM job_queue
      WHERE job_id = %(job_id)s AND concurrency_key = %(key)s   -- ix_job_queue_concurrency_queued, in its order
        AND (%(key)s = '' OR workspace_id IS NOT DISTINCT FROM %(workspace_id)s)   -- the freed slot's workspace
        AND (state = 'queued') IS TRUE AND run_at <= now()   -- waiting for a slot (as the index writes it), due
      ORDER BY priority DESC, run_at               -- priority decides who gets a freed slot
      LIMIT 1
      FOR UPDATE SKIP LOCKED
    )
    UPDATE job_queue q SET dispatched_at = now() FROM next WHERE q.id = next.id
    RETURNING q.id
    """,
)


def next_in_line(conn: Conn, job_id: str, key: str, workspace_id: str | None) -> uuid.UUID | None:
    """The queued run that should take a concurrency slot just freed (publish it after commit)."""
    row = first(conn, NEXT_IN_LINE, {"job_id": job_id, "key": key, "workspace_id": workspace_id})
    return None if row is None else row["id"]


# --- step records and leases --------------------------------------------------------

STORE_STEP = Statement(
    "store_step",
    "Store one finished step's result, fenced on the claim token; committed before the next body starts.",
    """
    WITH run AS (
      SELECT id, workspace_id, attempts FROM job_queue
      WHERE id = %(run_id)s
        AND claim_token = %(token)s            -- fence: only the current holder writes
        AND (state = 'running') IS TRUE        -- a cancelled run stops at its next step boundary
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
    libpq=True,  # three a run: through libpq itself (driver.py)
)


def store_step(conn: Conn, claim_: Claim, step_id: str, output_json: str, elapsed: float) -> bool:
    """Store one step; ``False`` when nothing was written (fenced, or stored already)."""
    params = {"run_id": claim_.run_id, "token": claim_.token, "step_id": step_id, "output": output_json,
              "elapsed": elapsed}
    return first(conn, STORE_STEP, params) is not None


STORED_OUTPUT = Statement(
    "stored_output",
    "The output a step's record holds (the racing duplicate's, when this holder's insert found one).",
    "SELECT output FROM job_step WHERE run_id = %(run_id)s AND step_id = %(step_id)s   -- the memo key",
)


def stored_output(conn: Conn, claim_: Claim, step_id: str) -> Any:
    row = first(conn, STORED_OUTPUT, {"run_id": claim_.run_id, "step_id": step_id})
    assert row is not None, "stored_output: the step has no record"
    return row["output"]


RENEW_LEASES = Statement(
    "renew_leases",
    "The heartbeat of every run one process (or its renewer) holds: one fenced UPDATE for all of them.",
    """
    UPDATE job_queue q SET lease_expires_at = now() + make_interval(secs => %(lease)s)
    FROM unnest(CAST(%(run_ids)s AS uuid[]), CAST(%(tokens)s AS uuid[])) AS h(run_id, token)
    WHERE q.id = h.run_id
      AND q.claim_token = h.token              -- fence: each holder renews only its own claim
      AND (q.state = 'running') IS TRUE        -- a settled or cancelled run is not renewed
    RETURNING q.id
    """,
)


def renew_claims(conn: Conn, held: Sequence[tuple[uuid.UUID, uuid.UUID]], lease_seconds: float) -> set[uuid.UUID]:
    """Renew the leases of ``held`` (run id, claim token) pairs in one statement; the run ids still held."""
    params = {"lease": lease_seconds, "run_ids": [run_id for run_id, _ in held], "tokens": [token for _, token in held]}
    return {r["id"] for r in rows(conn, RENEW_LEASES, params)}


def renew_lease(conn: Conn, claim_: Claim, lease_seconds: float) -> bool:
    return claim_.run_id in renew_claims(conn, [(claim_.run_id, claim_.token)], lease_seconds)


RUN_STATE = Statement(
    "run_state",
    "Cold path after a refused write: the run's state and whether this holder's token still holds it.",
    "SELECT state, claim_token = %(token)s AS ours FROM job_queue WHERE id = %(run_id)s",
)


def why_fenced(conn: Conn, claim_: Claim) -> str:
    """Cold path after a refused write: 'cancelled', 'lost' (reclaimed) or 'held' (still ours)."""
    row = first(conn, RUN_STATE, {"run_id": claim_.run_id, "token": claim_.token})
    if row is None:
        return "lost"
    if row["state"] == "cancelled":
        return "cancelled"
    return "held" if row["ours"] else "lost"


# --- sleeps and waits ---------------------------------------------------------------------

STORE_CLOCK_STEP = Statement(
    "store_clock_step",
    "Memoize a sleep's or a wait's window {since, until} on the database's clock, fenced on the claim token.",
    """
    INSERT INTO job_step (run_id, step_id, workspace_id, output, attempt, started_at)
    SELECT q.id, %(step_id)s, q.workspace_id,
           -- both instants from the database clock (or the caller's absolute instant)
           jsonb_build_object('since', now(),
                              'until', coalesce(CAST(%(until)s AS timestamptz),
                                                now() + make_interval(secs => CAST(%(secs)s AS float8)))),
           q.attempts, now()
    FROM job_queue q
    WHERE q.id = %(run_id)s AND q.claim_token = %(token)s AND (q.state = 'running') IS TRUE   -- fence
    FOR SHARE OF q
    ON CONFLICT (run_id, step_id) DO NOTHING
    RETURNING output, now() AS db_now
    """,
)


def store_clock_step(conn: Conn, claim_: Claim, step_id: str, *, seconds: float | None = None,
                     until: datetime | None = None) -> tuple[Any, datetime] | None:
    """Memoize {"since": now(), "until": now() + seconds | until} for step.sleep / waits.
    Returns (output, db_now), or None when fenced."""
    row = first(conn, STORE_CLOCK_STEP, {"run_id": claim_.run_id, "token": claim_.token, "step_id": step_id,
                                         "secs": seconds, "until": until})
    return None if row is None else (row["output"], row["db_now"])


SUSPEND = Statement(
    "suspend",
    "Give the worker back without charging the attempt (sleep, wait, deferral): queued again at run_at, fenced.",
    """
    WITH settled AS (
      UPDATE job_queue
      SET state = 'queued',
          run_at = coalesce(CAST(%(until)s AS timestamptz), now() + make_interval(secs => CAST(%(delay)s AS float8))),
          attempts = attempts - 1,                -- a sleep, a wait or a rate-limit deferral is not a failure
          deferrals = deferrals + CAST(%(deferred)s AS int),
          -- the sweeper publishes it once due: "message older than republish_after" then holds at run_at
          dispatched_at = coalesce(CAST(%(until)s AS timestamptz),
                                   now() + make_interval(secs => CAST(%(delay)s AS float8)))
                          - make_interval(secs => CAST(%(after)s AS float8)),
          wait_event = %(wait_event)s, wait_path = CAST(%(wait_path)s AS text[]), wait_value = %(wait_value)s,
          claim_token = NULL, claimed_by = NULL, lease_expires_at = NULL
      WHERE id = %(run_id)s AND claim_token = %(token)s AND (state = 'running') IS TRUE   -- fence
      RETURNING id, run_at
    ), ledger AS (
      UPDATE job_run r SET outcome = %(outcome)s, finished_at = now(), error = CAST(%(error)s AS jsonb)
      FROM settled s WHERE r.run_id = s.id AND r.outcome = 'running'   -- the open attempt
    )
    SELECT run_at FROM settled
    """,
)


def suspend(conn: Conn, claim_: Claim, *, outcome: str, until: datetime | None = None,
            delay: float | None = None, republish_after: float, error_json: str | None = None,
            wait: tuple[str, list[str], str | None] | None = None) -> datetime | None:
    """Give the worker back without charging the attempt: queued again at ``until``
    (or ``now() + delay``). Returns the new run_at, or None when fenced."""
    name, path, value = wait or (None, None, None)
    row = first(conn, SUSPEND, {
        "run_id": claim_.run_id, "token": claim_.token, "outcome": outcome, "until": until, "delay": delay,
        "deferred": 1 if outcome == "deferred" else 0, "after": republish_after, "error": error_json,
        "wait_event": name, "wait_path": path, "wait_value": value})
    return None if row is None else row["run_at"]


LOCK_WAIT = Statement(
    "lock_wait",
    "step.wait_for_event's fence: the exclusive twin of the shared lock every send of that event name holds.",
    "SELECT pg_advisory_xact_lock(hashtext('motir.wait:' || %(name)s)) AS locked",
)


def lock_wait(conn: Conn, name: str) -> None:
    """Exclusive twin of record_event's shared lock: after it, every event of ``name``
    committed so far is visible, and every later one will see this transaction's waiter."""
    rows(conn, LOCK_WAIT, {"name": name})


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


def find_event(conn: Conn, name: str, path: list[str], value: str | None, since: datetime,
               workspace_id: str | None) -> dict[str, Any] | None:
    """The event a waiter of ``workspace_id`` looks back for (``id``, ``name``, ``data``), or None."""
    if value is None:
        return None
    return first(conn, FIND_EVENT, {"name": name, "path": path, "value": value, "since": since,
                                    "workspace_id": workspace_id})


# --- child runs (step.invoke / step.gather) -------------------------------------------

START_CHILDREN = Statement(
    "start_children",
    "Start the child runs of one step.invoke / step.gather (each once per (parent, step)), fenced on the parent's claim.",
    """
    WITH parent AS (
      SELECT id, workspace_id FROM job_queue
      WHERE id = %(run_id)s
        AND claim_token = %(token)s            -- fence: only the parent's current holder starts children
        AND (state = 'running') IS TRUE
      FOR SHARE                                -- a concurrent cancel of the parent waits, then cancels them
    ), spec AS (
      SELECT * FROM unnest(CAST(%(steps)s AS text[]), CAST(%(names)s AS text[]), CAST(%(datas)s AS jsonb[]),
                           CAST(%(keys)s AS text[]), CAST(%(job_ids)s AS text[]), CAST(%(max_attempts)s AS int[]),
                           CAST(%(policies)s AS text[]), CAST(%(priorities)s AS smallint[]),
                           CAST(%(singletons)s AS text[]), CAST(%(concurrency)s AS text[]),
                           CAST(%(cancel_keys)s AS text[]), CAST(%(detached)s AS boolean[]))
             AS s(step_id, name, data, key, job_id, max_attempts, retry_policy, priority, singleton_key,
                  concurrency_key, cancel_key, detached)
    ), e AS (
      INSERT INTO job_event (name, data, workspace_id, idempotency_key)
      SELECT s.name, s.data, p.workspace_id, s.key        -- the child carries the parent's workspace
      FROM parent p, spec s
      -- the key is derived from (parent run, step): a parent that runs this step again
      -- (retry, crash, redelivery) writes no second event (uq_job_event_idempotency)
      ON CONFLICT DO NOTHING
      RETURNING id, name, workspace_id, idempotency_key
    ), runs AS (
      INSERT INTO job_queue (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy, priority,
                             singleton_key, concurrency_key, cancel_key, traceparent, parent_run_id, parent_step_id,
                             detached)
      SELECT e.id, s.job_id, e.name, e.workspace_id, s.max_attempts, s.retry_policy, s.priority,
             s.singleton_key, s.concurrency_key, s.cancel_key, %(traceparent)s, p.id, s.step_id, s.detached
      FROM e JOIN spec s ON s.key = e.idempotency_key, parent p
      -- No conflict target: UNIQUE (parent_run_id, parent_step_id) is the arbiter of one child
      -- per (parent, step); (event_id, job_id) and the singleton index apply as to any run.
      ON CONFLICT DO NOTHING
      RETURNING id, job_id
    )
    SELECT id AS run_id, job_id, (SELECT count(*) FROM parent) AS held FROM runs
    UNION ALL SELECT NULL, NULL, (SELECT count(*) FROM parent)    -- always one row: is the parent still ours?
    """,
)


def start_children(conn: Conn, claim_: Claim, children_: Sequence[tuple[str, str, str, str, RunSpec]],
                   *, traceparent: str | None, detach: bool = False) -> tuple[bool, list[tuple[uuid.UUID, str]]]:
    """``children_``: (step key, event name, data as JSON, idempotency key, spec).
    Returns (parent still held, [(run_id, job_id) created now]) — publish those after commit."""
    params = {
        "run_id": claim_.run_id, "token": claim_.token, "traceparent": traceparent,
        "steps": [c[0] for c in children_], "names": [c[1] for c in children_], "datas": [c[2] for c in children_],
        "keys": [c[3] for c in children_], "job_ids": [c[4].job_id for c in children_],
        "max_attempts": [c[4].max_attempts for c in children_], "policies": [c[4].policy for c in children_],
        "priorities": [c[4].priority for c in children_], "singletons": [c[4].singleton_key for c in children_],
        "concurrency": [c[4].concurrency_key for c in children_],
        "cancel_keys": [c[4].cancel_key for c in children_], "detached": [detach for _ in children_],
    }
    found = rows(conn, START_CHILDREN, params)
    held = bool(found and found[-1]["held"])
    return held, [(r["run_id"], r["job_id"]) for r in found if r["run_id"] is not None]


LOCK_PARENT = Statement(
    "lock_parent",
    "The per-parent lock the trigger motir_run_settled takes before waking a parent (held to commit).",
    "SELECT pg_advisory_xact_lock(hashtextextended('motir.parent:' || CAST(%(run_id)s AS text), 0)) AS locked",
)


def lock_parent(conn: Conn, run_id: uuid.UUID) -> None:
    """After it, every child settle committed so far is visible, and every later one
    sees this transaction's suspension (and wakes it)."""
    rows(conn, LOCK_PARENT, {"run_id": run_id})


CHILDREN = Statement(
    "children",
    "The children of one step of a parent: state, result, and the error of their last attempt.",
    """
    SELECT c.parent_step_id AS step_id, c.id AS run_id, c.job_id, c.state, c.result,
           (SELECT r.error FROM job_run r
            WHERE r.run_id = c.id                    -- its ledger (ix_job_run_ledger)
            ORDER BY r.started_at DESC LIMIT 1) AS error
    FROM job_queue c
    WHERE c.parent_run_id = %(run_id)s               -- served by uq_job_queue_parent_run_id_parent_step_id
      AND c.parent_step_id = ANY(CAST(%(steps)s AS text[]))
    """,
)


def children(conn: Conn, run_id: uuid.UUID, steps: Sequence[str]) -> dict[str, dict[str, Any]]:
    return {r["step_id"]: r for r in rows(conn, CHILDREN, {"run_id": run_id, "steps": list(steps)})}


CANCEL_CHILDREN = Statement(
    "cancel_children",
    "Cancel the unfinished children of one step (its timeout passed); their ledgers closed.",
    """
    WITH cancelled AS (
      UPDATE job_queue
      SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL, wait_event = NULL
      WHERE parent_run_id = %(run_id)s AND parent_step_id = ANY(CAST(%(steps)s AS text[]))
        AND state IN ('queued', 'running')     -- a finished child stays as it ended
        AND NOT detached                       -- a detached child runs on; the parent stops waiting
      RETURNING id
    ), ledger AS (
      UPDATE job_run r SET outcome = 'cancelled', finished_at = now()
      FROM cancelled c WHERE r.run_id = c.id AND r.outcome = 'running'
    )
    SELECT id AS run_id FROM cancelled
    """,
)


def cancel_children(conn: Conn, run_id: uuid.UUID, steps: Sequence[str]) -> list[uuid.UUID]:
    return [r["run_id"] for r in rows(conn, CANCEL_CHILDREN, {"run_id": run_id, "steps": list(steps)})]


CLAIM_WAKES = Statement(
    "claim_wakes",
    "The parents these runs' settles made due, not yet handed to the broker: marked sent, to publish after commit.",
    """
    UPDATE job_queue p SET dispatched_at = now()     -- this caller publishes it; the sweeper need not
    FROM job_queue c
    WHERE c.id = ANY(CAST(%(run_ids)s AS uuid[]))    -- the children that settled (primary key)
      AND p.id = c.parent_run_id
      AND (p.state = 'queued') IS TRUE AND (p.wait_event = 'motir.children') IS TRUE   -- suspended for its children
      AND p.run_at <= now()                                         -- and due: its last child settled
      -- woken and not yet published: the trigger leaves dispatched_at at or before run_at
      -- ('-infinity' since 0011, now() before); the first caller to get here stamps it
      -- later than run_at, so of a settling worker, a sweeper and a cancel one publishes
      AND p.dispatched_at <= p.run_at
    RETURNING p.id AS run_id, p.job_id
    """,
)


def claim_wakes(conn: Conn, run_ids: Sequence[uuid.UUID]) -> list[tuple[uuid.UUID, str]]:
    """The parents the settles of ``run_ids`` woke, claimed for publishing (publish them after commit)."""
    if not run_ids:
        return []
    return [(r["run_id"], r["job_id"]) for r in rows(conn, CLAIM_WAKES, {"run_ids": list(run_ids)})]


# --- canvas members (core/worker/canvas.py) -------------------------------------------

START_MEMBERS = Statement(
    "start_members",
    "Start one batch of a canvas's member runs (each once per (parent, step); id, delay and priority given), fenced.",
    """
    WITH parent AS (
      SELECT id, workspace_id FROM job_queue
      WHERE id = %(run_id)s
        AND claim_token = %(token)s            -- fence: only the canvas run's current holder starts members
        AND (state = 'running') IS TRUE
      FOR SHARE                                -- a concurrent cancel of the canvas waits, then cancels them
    ), spec AS (
      SELECT * FROM unnest(CAST(%(steps)s AS text[]), CAST(%(names)s AS text[]), CAST(%(datas)s AS jsonb[]),
                           CAST(%(keys)s AS text[]), CAST(%(job_ids)s AS text[]), CAST(%(max_attempts)s AS int[]),
                           CAST(%(policies)s AS text[]), CAST(%(priorities)s AS smallint[]),
                           CAST(%(singletons)s AS text[]), CAST(%(concurrency)s AS text[]),
                           CAST(%(cancel_keys)s AS text[]), CAST(%(ids)s AS uuid[]), CAST(%(delays)s AS float8[]),
                           CAST(%(etas)s AS timestamptz[]))
             AS s(step_id, name, data, key, job_id, max_attempts, retry_policy, priority, singleton_key,
                  concurrency_key, cancel_key, id, delay, eta)
    ), e AS (
      INSERT INTO job_event (name, data, workspace_id, idempotency_key)
      SELECT s.name, s.data, p.workspace_id, s.key        -- a member carries the canvas run's workspace
      FROM parent p, spec s
      -- the key is derived from (canvas run, step): a canvas run that reaches this step again
      -- (retry, crash, redelivery, resume) writes no second event
      ON CONFLICT DO NOTHING
      RETURNING id, name, workspace_id, idempotency_key
    ), due AS (
      -- countdown= is a duration on the database's clock, eta= an absolute instant: never this process's clock
      SELECT s.*, coalesce(s.eta, now() + make_interval(secs => coalesce(s.delay, 0))) AS run_at FROM spec s
    ), runs AS (
      INSERT INTO job_queue (id, event_id, job_id, event_name, workspace_id, max_attempts, retry_policy, priority,
                             singleton_key, concurrency_key, cancel_key, traceparent, parent_run_id, parent_step_id,
                             run_at, dispatched_at)
      SELECT d.id, e.id, d.job_id, e.name, e.workspace_id, d.max_attempts, d.retry_policy, d.priority,
             d.singleton_key, d.concurrency_key, d.cancel_key, %(traceparent)s, p.id, d.step_id, d.run_at,
             -- due later than republish_after: no message now, the sweeper publishes it once due
             greatest(now(), d.run_at - make_interval(secs => %(after)s))
      FROM e JOIN due d ON d.key = e.idempotency_key, parent p
      -- No conflict target: UNIQUE (parent_run_id, parent_step_id) is the arbiter of one member per
      -- (canvas run, step); the id (derived from them, or the signature's task_id) and the singleton
      -- index refuse as for any run.
      ON CONFLICT DO NOTHING
      RETURNING id, job_id, run_at
    )
    SELECT id AS run_id, job_id, greatest(extract(epoch FROM run_at - now()), 0) AS due_in,
           (SELECT count(*) FROM parent) AS held FROM runs
    UNION ALL SELECT NULL, NULL, NULL, (SELECT count(*) FROM parent)    -- always one row: is the run still ours?
    """,
)


def start_members(conn: Conn, claim_: Claim, members: Sequence[tuple[str, str, str, str, RunSpec,
                                                                          uuid.UUID, float | None, datetime | None]],
                  *, traceparent: str | None, republish_after: float) -> tuple[bool, list[tuple[uuid.UUID, str, float]]]:
    """``members``: (step key, event name, data as JSON, idempotency key, spec, run id, delay, eta).
    Returns (canvas run still held, [(run_id, job_id, due in seconds) created now]) — publish after commit."""
    params = {
        "run_id": claim_.run_id, "token": claim_.token, "traceparent": traceparent, "after": republish_after,
        "steps": [m[0] for m in members], "names": [m[1] for m in members], "datas": [m[2] for m in members],
        "keys": [m[3] for m in members], "job_ids": [m[4].job_id for m in members],
        "max_attempts": [m[4].max_attempts for m in members], "policies": [m[4].policy for m in members],
        "priorities": [m[4].priority for m in members], "singletons": [m[4].singleton_key for m in members],
        "concurrency": [m[4].concurrency_key for m in members], "cancel_keys": [m[4].cancel_key for m in members],
        "ids": [m[5] for m in members], "delays": [m[6] for m in members], "etas": [m[7] for m in members],
    }
    found = rows(conn, START_MEMBERS, params)
    held = bool(found and found[-1]["held"])
    return held, [(r["run_id"], r["job_id"], float(r["due_in"] or 0.0)) for r in found if r["run_id"] is not None]


MEMBERS_WAITING = Statement(
    "members_waiting",
    "Whether any member of a canvas run is unfinished (taken under lock_parent, before it suspends).",
    """
    SELECT EXISTS (
      SELECT 1 FROM job_queue c
      WHERE c.parent_run_id = %(run_id)s                -- ix_job_queue_unfinished_children (0011)
        -- any step's: a canvas run awaits one step at a time and every member it starts, so an
        -- unfinished member is one of the current step's
        AND c.state IN ('queued', 'running')
    ) AS waiting
    """,
)


def members_waiting(conn: Conn, run_id: uuid.UUID) -> bool:
    row = first(conn, MEMBERS_WAITING, {"run_id": run_id})
    return bool(row and row["waiting"])


STEP_MEMBERS = Statement(
    "step_members",
    "The members one step of a canvas run started (the step itself, or its [i] members): state, result, last error.",
    """
    SELECT c.parent_step_id AS step_id, c.id AS run_id, c.job_id, c.state, c.result,
           CASE WHEN c.state <> 'succeeded' THEN          -- a success needs no error: one lookup per failure only
             (SELECT r.error FROM job_run r WHERE r.run_id = c.id   -- its ledger (ix_job_run_ledger)
              ORDER BY r.started_at DESC LIMIT 1) END AS error
    FROM job_queue c
    WHERE c.parent_run_id = %(run_id)s                   -- uq_job_queue_parent_run_id_parent_step_id
      AND (c.parent_step_id = %(step)s                   -- the step's one member
           OR starts_with(c.parent_step_id, %(step)s || '['))   -- or its group's members, step[0], step[1]...
    """,
)


def step_members(conn: Conn, run_id: uuid.UUID, step: str) -> dict[str, dict[str, Any]]:
    return {r["step_id"]: r for r in rows(conn, STEP_MEMBERS, {"run_id": run_id, "step": step})}


# --- settle ---------------------------------------------------------------------

SETTLE_SUCCEEDED = Statement(
    "settle_succeeded",
    "Mark a run succeeded with its result and close the attempt's ledger row, fenced on the claim token.",
    """
    WITH settled AS (
      UPDATE job_queue
      SET state = 'succeeded', result = CAST(%(result)s AS jsonb), finished_at = now(),
          claim_token = NULL, lease_expires_at = NULL,
          -- step.audit's values; NULL when the body set none, and coalesce keeps the column as it
          -- was (never cleared). Not indexed, never read by the claim; no statement of their own.
          provider_key = coalesce(CAST(%(provider_key)s AS varchar), provider_key),
          model_version = coalesce(CAST(%(model_version)s AS varchar), model_version)
      WHERE id = %(run_id)s
        AND claim_token = %(token)s            -- fence: only the current holder settles
        AND (state = 'running') IS TRUE        -- a cancelled run stays cancelled
      RETURNING id
    ), ledger AS (
      UPDATE job_run r SET outcome = 'succeeded', finished_at = now()
      FROM settled s WHERE r.run_id = s.id
        AND r.outcome = 'running'              -- the open attempt, not an earlier one
    )
    SELECT count(*) AS settled,
           -- async_commit (the engine's, on: docs/reliability.md): this commit does not wait for
           -- the WAL flush (one flush of a run's four; the reply, and the run's end, a flush sooner).
           -- Every step record before it is a flushed commit, so nothing a step stored can be
           -- lost. Hazard: a crash of Postgres itself within about three wal_writer_delay of the
           -- settle (and before any later flushed commit on the server) undoes it: the run is
           -- 'running' again, is reclaimed when its lease runs out, and replays from its stored
           -- steps (no body runs again; code outside the steps does, and its result is stored
           -- anew) -- on its last attempt the reclaim fails it into the DLQ as LeaseExpired,
           -- where `motir dlq resume` settles it from its steps. A reader (RunHandle.get, the
           -- result backend, Flower) may have seen it succeeded before the crash.
           CASE WHEN %(async_commit)s THEN set_config('synchronous_commit', 'off', true) END AS async_commit
    FROM settled
    """,
    libpq=True,  # once a run: through libpq itself (driver.py)
)


def settle_succeeded(conn: Conn, claim_: Claim, result_json: str, *, async_commit: bool,
                     provider_key: str | None = None, model_version: str | None = None) -> bool:
    """Settle a run that succeeded (with what ``step.audit`` set, if anything); ``False`` when fenced
    (cancelled or reclaimed)."""
    row = first(conn, SETTLE_SUCCEEDED, {"run_id": claim_.run_id, "token": claim_.token, "result": result_json,
                                         "async_commit": async_commit, "provider_key": provider_key,
                                         "model_version": model_version})
    return row is not None and row["settled"] == 1


SETTLE_RETRY = Statement(
    "settle_retry",
    "Queue a failed attempt's run again after its backoff and close the attempt's ledger row, fenced.",
    """
    WITH settled AS (
      UPDATE job_queue
      SET state = 'queued',
          run_at = now() + make_interval(secs => %(delay)s),   -- the backoff, on the database's clock
          dispatched_at = now(),                               -- the caller publishes right after commit
          claim_token = NULL, claimed_by = NULL, lease_expires_at = NULL
      WHERE id = %(run_id)s AND claim_token = %(token)s AND (state = 'running') IS TRUE   -- fence
      RETURNING id, attempts
    )
    UPDATE job_run r SET outcome = 'retrying', finished_at = now(), error = CAST(%(error)s AS jsonb)
    FROM settled s WHERE r.run_id = s.id AND r.outcome = 'running'   -- the open attempt
    RETURNING 1 AS settled
    """,
)


def settle_retry(conn: Conn, claim_: Claim, error_json: str, delay: float) -> bool:
    params = {"run_id": claim_.run_id, "token": claim_.token, "error": error_json, "delay": delay}
    return first(conn, SETTLE_RETRY, params) is not None


#: The DLQ row, copied from the CTE ``failed`` (id, workspace_id, job_id, event_id, event_name,
#: scheduled_for, attempts, failure): what an operator needs to act after the run and event are
#: purged. Shared by the two ways a run fails for good: a worker settling its last attempt
#: (SETTLE_FAILED), and the sweeper reclaiming a run whose last attempt lost its lease
#: (maintenance.RECLAIM_EXPIRED).
DLQ_ROW = """
    INSERT INTO job_run_dlq (run_id, workspace_id, function_id, event_id, event_name, event_data,
                             idempotency_key, failure, attempts, first_failed_at)
    SELECT f.id, f.workspace_id, f.job_id, f.event_id, f.event_name,
           coalesce(e.data, jsonb_build_object('scheduled_for', f.scheduled_for)),
           e.idempotency_key, f.failure, f.attempts,
           coalesce((SELECT min(r.finished_at) FROM job_run r
                     WHERE r.run_id = f.id AND r.outcome IN ('retrying', 'lost')), now())
    FROM failed f LEFT JOIN job_event e ON e.id = f.event_id
"""

SETTLE_FAILED = Statement(
    "settle_failed",
    "Mark a run failed for good and write its DLQ row in the same statement, fenced on the claim token.",
    """
    WITH failed AS (
      UPDATE job_queue
      SET state = 'failed', finished_at = now(), claim_token = NULL, lease_expires_at = NULL
      WHERE id = %(run_id)s AND claim_token = %(token)s AND (state = 'running') IS TRUE   -- fence
      RETURNING id, workspace_id, job_id, event_id, event_name, scheduled_for, attempts,
                CAST(%(error)s AS jsonb) AS failure
    ), ledger AS (
      UPDATE job_run r SET outcome = 'failed', finished_at = now(), error = CAST(%(error)s AS jsonb)
      FROM failed f WHERE r.run_id = f.id AND r.outcome = 'running'
    ), dlq AS ("""
    + DLQ_ROW
    + """
      RETURNING id
    )
    -- one statement, one transaction: a failed run without its DLQ row (or the
    -- reverse) cannot exist, whatever crashes when.
    SELECT id FROM dlq
    """,
)


def settle_failed(conn: Conn, claim_: Claim, error_json: str) -> uuid.UUID | None:
    """Mark the run failed and write its DLQ row; returns the DLQ id (None if fenced)."""
    row = first(conn, SETTLE_FAILED, {"run_id": claim_.run_id, "token": claim_.token, "error": error_json})
    return None if row is None else row["id"]


FAIL_UNDECODABLE = Statement(
    "fail_undecodable",
    "Fail a run whose claim could not be read (its data nested deeper than the worker decodes) into the DLQ at once.",
    """
    WITH failed AS (
      UPDATE job_queue
      SET state = 'failed', finished_at = now(), claim_token = NULL, lease_expires_at = NULL
      WHERE id = %(run_id)s
        AND job_id = %(job_id)s                                          -- the message's run, of its job
        AND (((state = 'running') IS TRUE AND claim_token = %(token)s)   -- this attempt's claim committed, unread
             -- or a claim made in a transaction (concurrency=, flow control) that the error rolled back:
             -- queued and due, as the claim found it
             OR ((state = 'queued') IS TRUE AND run_at <= now()))
      RETURNING id, workspace_id, job_id, event_id, event_name, scheduled_for, attempts,
                CAST(%(error)s AS jsonb) AS failure
    ), ledger AS (
      UPDATE job_run r SET outcome = 'failed', finished_at = now(), error = CAST(%(error)s AS jsonb)
      FROM failed f WHERE r.run_id = f.id AND r.outcome = 'running'
    ), dlq AS (
      INSERT INTO job_run_dlq (run_id, workspace_id, function_id, event_id, event_name, event_data,
                               idempotency_key, failure, attempts, first_failed_at)
      -- Not the event's data: no reader of the DLQ could decode it either. It stays in job_event.
      SELECT f.id, f.workspace_id, f.job_id, f.event_id, f.event_name,
             jsonb_build_object('undecodable', 'the data of event ' || coalesce(f.event_id::text, '(none)')
                                || ' is nested deeper than a worker decodes'),
             e.idempotency_key, f.failure, f.attempts, now()
      FROM failed f LEFT JOIN job_event e ON e.id = f.event_id
      RETURNING id
    )
    SELECT id FROM dlq
    """,
)


def fail_undecodable(conn: Conn, run_id: uuid.UUID, job_id: str, token: uuid.UUID, error_json: str) -> uuid.UUID | None:
    """Fail the run whose claim could not be decoded, with its DLQ row; the DLQ id (None: not ours)."""
    row = first(conn, FAIL_UNDECODABLE, {"run_id": run_id, "job_id": job_id, "token": token, "error": error_json})
    return None if row is None else row["id"]


# --- progress and streams (core/worker/streams.py) ------------------------------------------
#
# Advisory writes, each its own transaction on the attempt's connection, fenced like a step
# record, but committed without waiting for the WAL flush (``synchronous_commit = off`` for the
# transaction): a progress report or a stream item costs no flush. Hazard: a crash of Postgres
# itself loses the writes of about the last three ``wal_writer_delay`` (600 ms by default) that
# no flushed commit followed: never one made before a step's record (that record's flushed
# commit is later in the WAL and flushes them too), only those of the step in progress or of
# the code after the last step, which the run writes again when it is reclaimed and re-runs that
# part (same positions: core/worker/streams.py). A reader may have seen them before the crash.
# Each write notifies the run's channel (``motir_s_<run id in hex>``, migration 0019) at commit.

#: What one item counts against the run's bound beside its JSON: its row (what a million empty
#: items would otherwise store under any bound of bytes).
ITEM_OVERHEAD = 64

_HELD = """
    WITH run AS (
      SELECT id, workspace_id, attempts FROM job_queue
      WHERE id = %(run_id)s
        AND claim_token = %(token)s            -- fence: only the current holder writes
        AND (state = 'running') IS TRUE        -- a cancelled run stops at its next write
      -- FOR SHARE: a concurrent reclaim or cancel waits for this write to commit, or this
      -- statement re-checks the fence against the reclaimed row and writes nothing (so a
      -- stale holder never overwrites what the run's new holder wrote)
      FOR SHARE
    )"""

_NOTIFY = "pg_notify('motir_s_' || replace(CAST(%(run_id)s AS text), '-', ''), '')"

PROGRESS = Statement(
    "progress",
    "Store a running run's latest progress (state, meta), fenced on the claim token; no WAL flush waited for.",
    _HELD + f""", written AS (
      INSERT INTO job_progress AS p (run_id, workspace_id, state, meta, attempt, updated_at)
      SELECT id, workspace_id, %(state)s, CAST(%(meta)s AS jsonb), attempts, now() FROM run
      ON CONFLICT (run_id) DO UPDATE           -- one row per run: the latest report wins
      SET state = EXCLUDED.state, meta = EXCLUDED.meta, attempt = EXCLUDED.attempt, updated_at = EXCLUDED.updated_at
      RETURNING p.run_id
    ), notified AS (
      SELECT {_NOTIFY} FROM written            -- followers wake at commit
    )
    SELECT (SELECT count(*) FROM written) AS written, (SELECT count(*) FROM notified) AS notified,
           -- advisory: this commit does not wait for the WAL flush (the hazard above)
           set_config('synchronous_commit', 'off', true) AS async_commit
    """,
)


def progress(conn: Conn, claim_: Claim, state: str, meta_json: str) -> bool:
    """Store the run's latest progress; ``False`` when fenced (cancelled or reclaimed)."""
    row = first(conn, PROGRESS, {"run_id": claim_.run_id, "token": claim_.token, "state": state, "meta": meta_json})
    return row is not None and row["written"] == 1


STREAM_WRITE = Statement(
    "stream_write",
    "Write items of one stream of a running run at their positions (a re-run's overwrite), within the run's bound, fenced.",
    _HELD + f""", new AS (
      SELECT * FROM unnest(CAST(%(positions)s AS bigint[]), CAST(%(items)s AS jsonb[]), CAST(%(sizes)s AS int[]))
             AS n(position, item, bytes)
    ), old AS (
      -- what this write overwrites (a re-run's positions), as the statement's snapshot has it
      SELECT s.position, s.bytes FROM job_stream_item s
      WHERE s.run_id = %(run_id)s AND s.stream = %(stream)s      -- the primary key's prefix
        AND s.position = ANY(CAST(%(positions)s AS bigint[]))
    ), delta AS (
      SELECT count(*) - (SELECT count(*) FROM old) AS items,
             coalesce(sum(bytes), 0) - coalesce((SELECT sum(bytes) FROM old), 0) AS bytes
      FROM new
    ), tally AS (
      INSERT INTO job_progress AS p (run_id, workspace_id, attempt, streams, stream_items, stream_bytes)
      SELECT run.id, run.workspace_id, run.attempts, ARRAY[CAST(%(stream)s AS text)], delta.items, delta.bytes
      FROM run, delta
      WHERE delta.bytes + {ITEM_OVERHEAD} * delta.items <= %(limit)s   -- a first write past the bound writes nothing
      ON CONFLICT (run_id) DO UPDATE
      SET stream_items = p.stream_items + EXCLUDED.stream_items,
          stream_bytes = p.stream_bytes + EXCLUDED.stream_bytes,
          streams = CASE WHEN CAST(%(stream)s AS text) = ANY(p.streams) THEN p.streams
                         ELSE p.streams || EXCLUDED.streams END
      -- the run's bound, decided here, atomically with the write: past it nothing is written
      WHERE p.stream_bytes + EXCLUDED.stream_bytes
            + {ITEM_OVERHEAD} * (p.stream_items + EXCLUDED.stream_items) <= %(limit)s
        -- and a bounded number of streams (a new name past it is refused)
        AND (CAST(%(stream)s AS text) = ANY(p.streams) OR cardinality(p.streams) < %(max_streams)s)
      RETURNING p.run_id
    ), written AS (
      INSERT INTO job_stream_item (run_id, stream, position, workspace_id, item, bytes, attempt)
      SELECT run.id, %(stream)s, new.position, run.workspace_id, new.item, new.bytes, run.attempts
      FROM new, run, tally                     -- only when the tally took the write
      -- the position is derived from the step and the order: a re-run writes the same one again
      ON CONFLICT (run_id, stream, position) DO UPDATE
      SET item = EXCLUDED.item, bytes = EXCLUDED.bytes, attempt = EXCLUDED.attempt
      RETURNING 1 AS one
    ), notified AS (
      SELECT {_NOTIFY} FROM (SELECT 1 FROM written LIMIT 1) w   -- followers wake at commit
    )
    SELECT (SELECT count(*) FROM run) AS held, (SELECT count(*) FROM written) AS written,
           (SELECT count(*) FROM old) AS overwritten, (SELECT count(*) FROM notified) AS notified,
           -- advisory: this commit does not wait for the WAL flush (the hazard above)
           set_config('synchronous_commit', 'off', true) AS async_commit
    """,
)


def stream_write(conn: Conn, claim_: Claim, stream: str, positions: Sequence[int], items_json: Sequence[str],
                 sizes: Sequence[int], *, limit: int, max_streams: int) -> dict[str, int]:
    """Write items at ``positions``: ``held`` 0 when fenced, ``written`` 0 when over the run's bound,
    ``overwritten``: how many of the positions held an item already (an earlier attempt's)."""
    row = first(conn, STREAM_WRITE, {"run_id": claim_.run_id, "token": claim_.token, "stream": stream,
                                     "positions": list(positions), "items": list(items_json), "sizes": list(sizes),
                                     "limit": limit, "max_streams": max_streams})
    assert row is not None
    return {"held": int(row["held"]), "written": int(row["written"]), "overwritten": int(row["overwritten"])}


STREAM_TRIM = Statement(
    "stream_trim",
    "A re-run's segment ended: delete that segment's items an earlier attempt wrote past this one's last, fenced.",
    _HELD + """, gone AS (
      DELETE FROM job_stream_item s USING run
      WHERE s.run_id = run.id AND s.stream = %(stream)s          -- the primary key's prefix
        AND s.position > %(last)s AND s.position < %(until)s     -- past this attempt's last, within the segment
      RETURNING s.bytes
    ), tally AS (
      UPDATE job_progress p
      SET stream_items = p.stream_items - (SELECT count(*) FROM gone),
          stream_bytes = p.stream_bytes - (SELECT coalesce(sum(bytes), 0) FROM gone)
      FROM run WHERE p.run_id = run.id         -- the run's own row
      RETURNING 1 AS one
    )
    SELECT (SELECT count(*) FROM run) AS held, (SELECT count(*) FROM gone) AS trimmed,
           (SELECT count(*) FROM tally) AS tallied,
           set_config('synchronous_commit', 'off', true) AS async_commit
    """,
)


def stream_trim(conn: Conn, claim_: Claim, stream: str, last: int, until: int) -> bool:
    """Delete the items of ``stream`` at positions in (``last``, ``until``); ``False`` when fenced."""
    row = first(conn, STREAM_TRIM, {"run_id": claim_.run_id, "token": claim_.token, "stream": stream,
                                    "last": last, "until": until})
    return row is not None and row["held"] == 1
