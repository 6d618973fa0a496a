"""``resume_dlq``: the same run again, from its failed step (issue 20).

Replay re-emits the event as a **new** run: every step runs again (two invoices for
one order, if ``invoice`` came before the step that failed). Resume queues **the
same run** again: its stored steps stay, so the handler returns their stored values
and carries on at the step that failed. The run gets a fresh attempt budget
(``attempts`` back to 0, ``max_attempts`` as recorded at enqueue).

Decided by one conditional ``UPDATE`` (``store/sql/operator.py``'s ``RESUME``): it stamps
``resumed_at`` / ``resumed_by`` on an entry that is neither resumed, replayed nor
dismissed, moves its ``run_id`` to ``resumed_run_id`` (the entry is closed; should
the run fail again it gets an entry of its own) and queues the run — in one
statement, so of two concurrent resumes one queues the run and the other is told
``already_resumed``. Published after commit. An entry is answered once: resumed,
replayed or dismissed.

``resume_as`` is the operator surface's form (docs/security.md): the entry is first
read under the app role in the caller's context, then resumed through the engine.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Literal

from motir_celery.core.operator.dlq import Caller, check_actor, parse_id, visible
from motir_celery.core.publish import Publish, publish_or_log
from motir_celery.settings import Settings
from motir_celery.store.db import get_engine
from motir_celery.store.sql import operator as operator_sql

__all__ = ["ResumeResult", "resume_dlq", "resume_as"]

log = logging.getLogger("motir_celery.core.operator.dlq")


@dataclass(frozen=True)
class ResumeResult:
    status: Literal["resumed", "already_resumed", "replayed", "dismissed", "purged", "not_found"]
    run_id: uuid.UUID | None = None


def resume_dlq(dlq_id: uuid.UUID | str, *, actor: str, publish: Publish | None = None,
               settings: Settings | None = None) -> ResumeResult:
    """Queue the entry's failed run again from its failed step; audited as ``actor``."""
    check_actor(actor)
    did = uuid.UUID(str(dlq_id))
    with get_engine(settings=settings).connect() as conn:
        with conn.begin() as tx:
            row = operator_sql.resume(conn, did, actor)
            if row["stamped"] and row["run_id"] is None:
                tx.rollback()  # the run is not failed (cannot happen while its entry is open): change nothing
            if not row["stamped"] or row["run_id"] is None:
                status = operator_sql.entry_status(conn, did)
                if status is None:
                    return ResumeResult("not_found")
                if status["resumed"]:
                    return ResumeResult("already_resumed", status["resumed_run_id"])
                if status["replayed"]:
                    return ResumeResult("replayed")
                if status["dismissed"]:
                    return ResumeResult("dismissed")
                return ResumeResult("purged")
    if publish is not None:
        publish_or_log(publish, row["run_id"], row["job_id"])
    return ResumeResult("resumed", row["run_id"])


def resume_as(caller: Caller, dlq_id: uuid.UUID | str, *, publish: Publish | None = None,
              settings: Settings | None = None) -> ResumeResult:
    """``resume_dlq`` of an entry ``caller`` can see; ``not_found`` for one they cannot."""
    check_actor(caller.actor)
    did = parse_id(dlq_id)
    if did is None or not visible(caller, operator_sql.DLQ_VISIBLE, did, settings):
        return ResumeResult("not_found")
    result = resume_dlq(did, actor=caller.actor, publish=publish, settings=settings)
    log.info("DLQ %s resume by %s (workspace %s%s): %s", did, caller.actor, caller.workspace,
             ", admin" if caller.admin else "", result.status)
    return result
