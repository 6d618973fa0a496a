"""The exceptions motir-celery raises or understands. Layer 1: imports nothing of ours."""

from __future__ import annotations

import math
import uuid
from typing import Callable

__all__ = [
    "MotirError",
    "ConfigurationError",
    "JobDefinitionError",
    "UnknownJobError",
    "PayloadError",
    "StepOutputError",
    "StepIdError",
    "AuditValueError",
    "WorkspaceError",
    "NonRetriableError",
    "RetryAfterError",
    "RetryRequested",
    "LostClaim",
    "RunCancelled",
    "RateLimited",
    "Suspended",
    "RunFailed",
    "StreamFull",
]


class MotirError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigurationError(MotirError):
    """A setting is missing or malformed; the message names the variable."""


class JobDefinitionError(MotirError):
    """``define_job`` was called with something that cannot work."""


class UnknownJobError(MotirError):
    """A job id that no ``define_job`` in this process registered."""


class PayloadError(MotirError, ValueError):
    """Event data that is not JSON, or too large. Raised before anything is written."""


class StepOutputError(MotirError, TypeError):
    """A step returned a value that cannot be stored as JSON."""


class WorkspaceError(MotirError, ValueError):
    """A workspace id that cannot be used as one."""


class NonRetriableError(MotirError):
    """Raise from a handler to fail the run now: no retry, straight to the DLQ."""


#: The longest delay a handler may ask for (``RetryAfterError``, ``RateLimited``): one year.
MAX_DELAY_SECONDS = 365 * 24 * 3600.0


def checked_delay(what: str, value: object) -> float:
    """``value`` as seconds, or ``ValueError`` naming it: a number, finite, from 0 to a year.
    Checked where the delay is raised, so Postgres never sees one it would refuse."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, got {value!r:.100}")
    seconds = float(value)
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_DELAY_SECONDS:
        raise ValueError(f"{what} must be finite, >= 0 and at most {MAX_DELAY_SECONDS:.0f} s (a year), got {value!r}")
    return seconds


class RetryAfterError(MotirError):
    """Raise from a handler to retry after ``delay`` seconds (charges an attempt)."""

    def __init__(self, delay: float, message: str = "") -> None:
        self.delay = checked_delay("RetryAfterError delay", delay)
        super().__init__(message or f"retry requested in {self.delay}s")


class RetryRequested(RetryAfterError):
    """A retry a Celery task asked for itself (``self.retry``, ``autoretry_for``): the run is queued
    again after ``delay`` whatever its attempt budget (the task's ``max_retries`` decided already),
    and, when ``publish`` is given, its next message is the one Celery built for the retry (its
    arguments, its ``retries`` count), sent once the settle is committed."""

    def __init__(self, delay: float, message: str = "", *,
                 publish: Callable[[uuid.UUID, str, float], None] | None = None) -> None:
        super().__init__(delay, message)
        self.publish = publish


class LostClaim(MotirError):
    """This worker no longer holds the run: its lease was reclaimed or the run was
    cancelled. Every further write is refused by the database, so the execution stops."""


class RunCancelled(LostClaim):
    """The run was cancelled; the execution stops at its step boundary."""


class RateLimited(MotirError):
    """Raise from a handler when a dependency says "not now": the run is put back for
    ``retry_after`` seconds **without** charging an attempt (counted as a deferral),
    because waiting one's turn is not failing."""

    def __init__(self, retry_after: float, message: str = "") -> None:
        self.retry_after = checked_delay("RateLimited retry_after", retry_after)
        super().__init__(message or f"rate limited; again in {self.retry_after}s")


class Suspended(BaseException):
    """Internal: step.sleep / step.wait_for_event gave the worker back; the run is
    already queued again. A BaseException, so a handler's ``except Exception``
    cannot swallow it."""

    def __init__(self, until: object) -> None:
        super().__init__(f"suspended until {until}")
        self.until = until


class RunFailed(MotirError):
    """Raised by a Celery task after its run failed for good (already in the DLQ),
    so Flower shows the task as FAILURE. Never raised to user code."""


class StepIdError(NonRetriableError, ValueError):
    """A step id that cannot be stored: empty, too long, or with a reserved or
    unprintable character. Raised by ``step.run`` before its body; retrying would
    not change it, so the run goes straight to the DLQ."""


class AuditValueError(NonRetriableError, ValueError):
    """A ``step.audit`` value that cannot be stored: not a string, empty, over ``AUDIT_MAX``
    characters, or with a NUL or unprintable character. Raised at the call, nothing of it kept
    (the run's stored steps stay); not caught, it fails the run into the DLQ (a retry would set
    the same again)."""


class StreamFull(NonRetriableError):
    """A stream write past the run's bound (``MOTIR_MAX_STREAM_BYTES`` of items, or more than
    ``MAX_STREAMS`` stream names): nothing of that write is stored. Raised to the handler at the
    write; not caught, it fails the run into the DLQ (a retry would write the same again)."""
