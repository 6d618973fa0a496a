"""Optional OpenTelemetry tracing: a run is a child of the span that sent its event.

``send_event`` stores the W3C ``traceparent`` active in the caller on every run
it creates; the worker opens the run's span as that context's child, and each
executed step as a child of the run's span. Without ``opentelemetry-api``
installed (the ``tracing`` extra) every function here is a no-op that costs one
attribute lookup: nothing is imported on the hot path.

With the API installed but no SDK configured (the global tracer provider is
still OpenTelemetry's proxy or no-op one), ``run_span``/``step_span`` return a
``nullcontext`` instead of entering no-op spans, which cost a few percent of a
pool child's CPU. The provider is checked at each call: once the application
calls ``trace.set_tracer_provider(...)``, even after this module was imported,
spans are made (our proxy tracer then delegates to the new provider).
``current_traceparent`` does not depend on the provider: it propagates whatever
span is active in the caller.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

__all__ = ["current_traceparent", "run_span", "step_span"]

try:  # pragma: no cover - exercised by whichever environment has it
    from opentelemetry import propagate, trace

    _tracer: Any = trace.get_tracer("motir_celery")
    # What get_tracer_provider() returns while no SDK is set up: all their spans are no-ops.
    _NO_SDK: tuple[type, ...] = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
except ImportError:  # the extra is not installed
    propagate = trace = None  # type: ignore[assignment]
    _tracer = None


def current_traceparent() -> str | None:
    if propagate is None:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


def _recording() -> bool:
    """Whether a span made through ``_tracer`` now would be a real one."""
    tracer = _tracer
    if tracer is None:
        return False
    # Ours, got before any provider was set: it follows whatever the global one is now.
    if isinstance(tracer, trace.ProxyTracer):
        return not isinstance(trace.get_tracer_provider(), _NO_SDK)
    # A tracer from a real provider (set before import, or swapped in by a test).
    return not isinstance(tracer, trace.NoOpTracer)


@contextmanager
def _span(name: str, parent: Any, attributes: dict[str, Any]) -> Iterator[Any]:
    with _tracer.start_as_current_span(name, context=parent, attributes=attributes) as span:
        yield span


def run_span(job_id: str, run_id: str, attempt: int, traceparent: str | None) -> ContextManager[Any]:
    """The run's span, child of the sender's (or a root span when none was stored)."""
    if not _recording():
        return nullcontext()
    parent = propagate.extract({"traceparent": traceparent}) if traceparent else None
    return _span(f"motir.run {job_id}", parent,
                 {"motir.job_id": job_id, "motir.run_id": run_id, "motir.attempt": attempt})


def step_span(step_id: str) -> ContextManager[Any]:
    """An executed step's span, child of the current (run) span. Memo hits make none."""
    if not _recording():
        return nullcontext()
    return _span(f"motir.step {step_id}", None, {"motir.step_id": step_id})
