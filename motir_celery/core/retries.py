"""Retry policies: how many attempts a run gets and how long it waits between them.

Three named policies cover most jobs; ``RetryPolicy`` is for the rest.

* ``transient`` — 3 attempts, exponential backoff from 10 s. The default: a
  network blip, a deadlock, a 503 from a dependency.
* ``idempotent`` — 5 attempts, backoff from 30 s. For work that is safe to
  repeat (reads, upserts, naturally idempotent calls) and worth persisting with.
* ``none`` — 1 attempt. For work where a retry is wrong ("send the signup
  notification once or not at all"): the first failure goes to the DLQ.

The run row records the policy's name and attempt budget at enqueue time, so
operators see it and a redeploy cannot change a run in flight.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from motir_celery.errors import JobDefinitionError

__all__ = ["RetryPolicy", "POLICIES", "resolve_policy"]


@dataclass(frozen=True)
class RetryPolicy:
    #: Total attempts, the first included. 1 = never retry.
    max_attempts: int = 3
    #: Delay before the second attempt, in seconds.
    backoff: float = 10.0
    #: Each further delay is multiplied by this (1.0 = constant backoff).
    factor: float = 2.0
    #: Upper bound for one delay.
    max_backoff: float = 3600.0
    #: Fraction of the delay added or removed at random, so a burst of runs that
    #: failed together does not retry together (0 = none, 0.25 = ±25%).
    jitter: float = 0.25
    name: str = "custom"

    def __post_init__(self) -> None:
        # Every number finite and of the right type: NaN compares false with every bound
        # below (so it would pass them) and an infinite delay cannot be stored as run_at.
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise JobDefinitionError(f"RetryPolicy.max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        for name in ("backoff", "factor", "max_backoff", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise JobDefinitionError(f"RetryPolicy.{name} must be a finite number, got {value!r}")
        if self.backoff < 0 or self.max_backoff < 0 or self.factor < 1:
            raise JobDefinitionError(f"RetryPolicy backoff must be >= 0 and factor >= 1, got {self!r}")
        if not 0 <= self.jitter < 1:
            raise JobDefinitionError(f"RetryPolicy.jitter must be in [0, 1), got {self.jitter}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        try:
            grown = self.backoff * self.factor ** max(attempt - 1, 0)
        except OverflowError:  # factor ** attempt beyond a float: the cap applies
            grown = self.max_backoff
        base = min(grown, self.max_backoff)
        if self.jitter:
            base *= 1 + random.uniform(-self.jitter, self.jitter)
        return max(base, 0.0)


POLICIES: dict[str, RetryPolicy] = {
    "transient": RetryPolicy(max_attempts=3, backoff=10.0, factor=2.0, name="transient"),
    "idempotent": RetryPolicy(max_attempts=5, backoff=30.0, factor=3.0, name="idempotent"),
    "none": RetryPolicy(max_attempts=1, name="none"),
}


def resolve_policy(policy: str | RetryPolicy) -> RetryPolicy:
    if isinstance(policy, RetryPolicy):
        return policy
    try:
        return POLICIES[policy]
    except (KeyError, TypeError):
        raise JobDefinitionError(
            f"unknown retry_policy {policy!r}; use one of {sorted(POLICIES)} or RetryPolicy(...)"
        ) from None
