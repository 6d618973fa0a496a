"""What the Celery side sends through the engine login: a message adopted or refused, and the result backend's read.

A worker that receives a message in Celery's own protocol for a direct job adopts it
with ``producer.DIRECT_RUN`` (the run ``.delay()`` writes); one whose arguments cannot
be stored is kept as ``ADOPT_REFUSED`` writes it. ``adapter/backend.py`` answers
``AsyncResult(<run id>)`` with ``producer.RUN_RESULT`` in the caller's workspace, or, in an
operator's process that asked for it (MOTIR_RESULTS_ANY_WORKSPACE), with ``RUN_META``.
Both run as the engine role: the app role inserts nothing since 0009.
"""

from __future__ import annotations

from motir_celery.store.driver import Statement
from motir_celery.store.sql.producer import RESULT_OF_RUN

AUDIENCE = "adapter"
ROLES = ("motir_engine",)

RUN_META = Statement(
    "run_meta",
    "A run's state, result and latest error by its id alone, any workspace's (an operator's result backend, Flower).",
    # No workspace predicate: only with MOTIR_RESULTS_ANY_WORKSPACE=1, which an operator sets
    # for Flower; a producer's AsyncResult(id) reads producer.RUN_RESULT in its own workspace.
    RESULT_OF_RUN,
)

# A message in Celery's protocol for a direct job whose arguments cannot be stored (not
# JSON, over MOTIR_MAX_PAYLOAD_BYTES, a workspace_id that is not one): instead of a run,
# a run that failed at once and its DLQ row, so the refusal is where operators look
# (motir dlq list, the dashboard) and AsyncResult(<its task id>) answers FAILURE. The
# event holds what can be shown of the message, not its arguments. Written by a worker
# (the engine role), one statement.
ADOPT_REFUSED = Statement(
    "adopt_refused",
    "A Celery-protocol message a worker could not adopt: its event, a run failed at once and its DLQ row (one statement).",
    """
    WITH e AS (
      INSERT INTO job_event (name, data, workspace_id, idempotency_key)
      VALUES (%(name)s, CAST(%(data)s AS jsonb), NULL, %(key)s)
      -- (workspace, name, key) is unique: a redelivered copy of the refused message writes nothing
      ON CONFLICT DO NOTHING
      RETURNING id, name, data, idempotency_key
    ), chosen AS (
      INSERT INTO job_queue (id, event_id, job_id, event_name, workspace_id, max_attempts, retry_policy,
                             state, finished_at)
      SELECT coalesce(CAST(%(run_id)s AS uuid), gen_random_uuid()), e.id, %(job_id)s, e.name, NULL, 1,
             %(policy)s, 'failed', now()
      FROM e
      ON CONFLICT DO NOTHING                   -- the task id is another run's already: a fresh id below
      RETURNING id, job_id, event_id, event_name
    ), fresh AS (
      INSERT INTO job_queue (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy, state,
                             finished_at)
      SELECT e.id, %(job_id)s, e.name, NULL, 1, %(policy)s, 'failed', now()
      FROM e WHERE NOT EXISTS (SELECT 1 FROM chosen)   -- only when the first INSERT wrote nothing
      RETURNING id, job_id, event_id, event_name
    ), failed AS (
      SELECT * FROM chosen UNION ALL SELECT * FROM fresh
    ), dlq AS (
      INSERT INTO job_run_dlq (run_id, workspace_id, function_id, event_id, event_name, event_data,
                               idempotency_key, failure, attempts, first_failed_at)
      SELECT f.id, NULL, f.job_id, f.event_id, f.event_name, e.data, e.idempotency_key,
             CAST(%(failure)s AS jsonb), 0, now()
      FROM failed f JOIN e ON e.id = f.event_id
      RETURNING id, run_id
    )
    SELECT id AS dlq_id, run_id FROM dlq
    """,
)

# Celery's revoke of a durable task's run (adapter/tasks.py: AsyncResult(id).revoke(),
# app.control.revoke, a worker dropping a revoked or expired message).
REVOKE = Statement(
    "revoke",
    "Cancel the run of a revoked Celery task: a queued one; with terminate, a running one too (stops at its next step).",
    """
    WITH revoked AS (
      UPDATE job_queue
      SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL, wait_event = NULL
      WHERE id = %(run_id)s
        AND (state = 'queued'                   -- not started: it never runs
             OR (%(terminate)s AND state = 'running'))   -- terminate=True: its next write is refused
      RETURNING id
    ), ledger AS (
      UPDATE job_run r SET outcome = 'cancelled', finished_at = now()
      FROM revoked c WHERE r.run_id = c.id AND r.outcome = 'running'   -- the open attempt
    )
    SELECT count(*) AS revoked FROM revoked
    """,
)
