"""``step.run``: memoized side effects.

The contract, plainly (docs/jobs.md says the same):

* A step whose result is stored is **never executed again** for that run —
  not on retry, not after a crash, not on a redelivered message, not on
  another worker. ``step.run`` returns the stored value instead.
* A step interrupted **before** its result was stored runs again on the next
  attempt: step bodies are at-least-once. Make them idempotent (or accept a
  rare repeat) for the window between the side effect and the store.
* The value a step returns is what JSON can carry; on the first execution too
  ``step.run`` returns the value as read back from JSON (a tuple comes back
  as a list both times), so a handler sees one type whichever path it took.

The store is fenced on the claim token. When it is refused, this worker no
longer holds the run (its lease was reclaimed, or the run was cancelled):
``LostClaim`` / ``RunCancelled`` stop the handler at this step boundary.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, TypeVar

from sqlalchemy import Connection

from .errors import LostClaim, RunCancelled, StepOutputError
from .queue import Claim, store_step, stored_output, why_fenced

__all__ = ["Step", "SEPARATOR", "encode_json"]

T = TypeVar("T")

#: Joins a repeated step id and its occurrence number (``charge``, ``charge:1``...).
#: Reserved: a step id may not contain it, so ``charge:1`` cannot collide.
SEPARATOR = ":"


def encode_json(value: Any, *, what: str, limit: int) -> str:
    try:
        encoded = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StepOutputError(f"{what} is not JSON-serialisable ({type(value).__name__}): {exc}") from None
    if len(encoded) > limit:
        raise StepOutputError(f"{what} is {len(encoded)} bytes of JSON, over the {limit}-byte limit")
    return encoded


class Step:
    """Handed to every handler as its second argument."""

    def __init__(self, claim: Claim, conn: Connection, *, max_bytes: int) -> None:
        self._claim = claim
        self._conn = conn
        self._memo: dict[str, Any] = dict(claim.steps)
        self._seen: dict[str, int] = {}
        self._max_bytes = max_bytes
        #: Step bodies executed (not replayed) in this attempt, for tests and metrics.
        self.executed: list[str] = []

    @property
    def run_id(self) -> str:
        return str(self._claim.run_id)

    @property
    def attempt(self) -> int:
        """This attempt's number, 1-based."""
        return self._claim.attempt

    def run(self, step_id: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        key = self._key(step_id)
        if key in self._memo:
            return self._memo[key]  # type: ignore[no-any-return]
        started = time.monotonic()
        value = fn(*args, **kwargs)
        encoded = encode_json(value, what=f"step {key!r} returned a value that", limit=self._max_bytes)
        elapsed = time.monotonic() - started  # a duration; the instant comes from now() in SQL
        conn = self._conn
        with conn.begin():  # one statement, one commit: the memo is durable before we go on
            stored = store_step(conn, self._claim, key, encoded, elapsed)
            reason = "" if stored else why_fenced(conn, self._claim)
            if reason == "held":
                # Still ours, but the step was already stored (a duplicate id
                # racing within one attempt): the stored value wins.
                encoded, stored = json.dumps(stored_output(conn, self._claim, key)), True
        if not stored:
            if reason == "cancelled":
                raise RunCancelled(f"run {self.run_id} was cancelled; stopped before storing step {key!r}")
            raise LostClaim(f"run {self.run_id}: this worker lost its claim; step {key!r} not stored")
        self.executed.append(key)
        result = json.loads(encoded)
        self._memo[key] = result
        return result  # type: ignore[no-any-return]

    def _key(self, step_id: str) -> str:
        if not isinstance(step_id, str) or not step_id:
            raise ValueError(f"step id must be a non-empty string, got {step_id!r}")
        if SEPARATOR in step_id:
            raise ValueError(
                f"step id {step_id!r} contains {SEPARATOR!r}, which is reserved for repeated steps"
            )
        n = self._seen.get(step_id, 0)
        self._seen[step_id] = n + 1
        return step_id if n == 0 else f"{step_id}{SEPARATOR}{n}"
