"""How the core hands a committed run to the broker without importing Celery.

The adapter builds a ``Publish`` callable (``adapter/messages.py``) and passes it
down; the core calls it only after the commit that created or requeued the row,
through ``publish_or_log``, so a broker that refuses never undoes a commit.
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable

__all__ = ["Publish", "publish_or_log"]

log = logging.getLogger("motir_celery.publish")

#: publish(run_id, job_id, countdown_seconds) — hands a run to the broker.
Publish = Callable[[uuid.UUID, str, float], None]


def publish_or_log(publish: Publish, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> bool:
    """Publish after a commit; a broker that refuses is logged, never raised.

    The row is already committed, so the run exists and the sweeper re-publishes
    it after ``MOTIR_REPUBLISH_AFTER``. Raising here would tell the caller that
    something failed which in fact happened — and a caller that retries a
    ``send_event`` without an idempotency key would then create it twice.
    """
    try:
        publish(run_id, job_id, countdown)
        return True
    except Exception:  # noqa: BLE001 — broker down, network blip: the sweeper covers it
        log.warning("could not publish run %s of %s (committed; the sweeper will re-publish it)",
                    run_id, job_id, exc_info=True)
        return False
