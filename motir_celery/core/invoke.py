"""``step.invoke`` / ``step.gather``: child runs awaited durably (issue 20)."""

from __future__ import annotations

import uuid
from typing import Any

from motir_celery.errors import NonRetriableError

__all__ = ["ChildFailed"]


class ChildFailed(NonRetriableError):
    """A child run ended failed or cancelled (or its wait timed out): raised into the parent
    at its step.invoke / step.gather, which the handler may catch. ``error`` is the stored
    error of the child's last attempt ({"type", "message", ...}); ``state`` is the child's."""

    def __init__(self, step_id: str, run_id: uuid.UUID | str | None, job_id: str, state: str,
                 error: dict[str, Any] | None) -> None:
        self.step_id, self.run_id, self.job_id, self.state = step_id, run_id, job_id, state
        self.error = error or {}
        super().__init__(f"child run {run_id} ({job_id}) of step {step_id!r} {state}: "
                         f"{self.error.get('type', '')}: {self.error.get('message', '')}")
