"""The exceptions motir-celery raises or understands. Layer 1: imports nothing of ours."""

from __future__ import annotations

__all__ = [
    "MotirError",
    "ConfigurationError",
    "JobDefinitionError",
    "UnknownJobError",
    "PayloadError",
    "StepOutputError",
    "WorkspaceError",
    "NonRetriableError",
    "RetryAfterError",
    "LostClaim",
    "RunCancelled",
    "RateLimited",
    "Suspended",
    "RunFailed",
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


class RetryAfterError(MotirError):
    """Raise from a handler to retry after ``delay`` seconds (charges an attempt)."""

    def __init__(self, delay: float, message: str = "") -> None:
        if delay < 0:
            raise ValueError(f"RetryAfterError delay must be >= 0, got {delay!r}")
        super().__init__(message or f"retry requested in {delay}s")
        self.delay = float(delay)


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
        if retry_after < 0:
            raise ValueError(f"RateLimited retry_after must be >= 0, got {retry_after!r}")
        super().__init__(message or f"rate limited; again in {retry_after}s")
        self.retry_after = float(retry_after)


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
