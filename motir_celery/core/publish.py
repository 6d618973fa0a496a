"""How the core hands a committed run to the broker without importing Celery.

The engine is given a ``Host`` (``adapter/hosts.py``: a Celery app; the test kit's; ``Inline``,
which runs each run here) and publishes through it only after the commit that created or
requeued the row, through ``publish_or_log``, so a broker that refuses never undoes a commit.
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable, Protocol, Sequence

from motir_celery.errors import ConfigurationError

__all__ = ["Publish", "PublishMany", "Host", "NoBroker", "publish_or_log"]

log = logging.getLogger("motir_celery.publish")

#: publish(run_id, job_id, countdown_seconds) — hands a run to the broker.
Publish = Callable[[uuid.UUID, str, float], None]
#: publish_many([(run_id, job_id), ...]) — every run due now, after the commit.
PublishMany = Callable[[Sequence[tuple[uuid.UUID, str]]], None]


class Host(Protocol):
    """Where the engine's runs go: one message per run, by job."""

    @property
    def eager(self) -> bool:
        """Runs execute in this process at once (Celery's eager mode, ``Inline``)."""
        ...

    def publish(self, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None: ...

    def publish_many(self, runs: Sequence[tuple[uuid.UUID, str]]) -> None: ...

    def routed(self, queue: str | None, priority: int | None) -> Publish:
        """The publish of one call's message with its own ``queue=`` / ``priority=``."""
        ...


class NoBroker:
    """The host of an engine with no broker configured (an operator's CLI): every publish is
    refused, and ``publish_or_log`` leaves the run to the sweeper, which publishes it from a worker."""

    eager = False

    def publish(self, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
        raise ConfigurationError("no broker here (CELERY_BROKER_URL is not set)")

    def publish_many(self, runs: Sequence[tuple[uuid.UUID, str]]) -> None:
        for run_id, job_id in runs:
            self.publish(run_id, job_id)

    def routed(self, queue: str | None, priority: int | None) -> Publish:
        return self.publish


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
    except ConfigurationError as exc:  # no broker in this process: a worker's sweeper sends it
        log.info("run %s of %s not published here (%s); the sweeper publishes it", run_id, job_id, exc)
        return False
    except Exception:  # noqa: BLE001 — broker down, network blip: the sweeper covers it
        log.warning("could not publish run %s of %s (committed; the sweeper will re-publish it)",
                    run_id, job_id, exc_info=True)
        return False
