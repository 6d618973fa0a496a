"""Jobs for the composition tests (issue 20): MOTIR_IMPORTS=tests.jobs,tests.compose_jobs.

Each body records its execution in ``test.side_effect`` (tests/jobs.py's ``record``).
"""

from __future__ import annotations

from typing import Any

from motir_celery import ChildFailed, NonRetriableError, RetryPolicy, define_job
from tests.jobs import record, recorded

FAST = RetryPolicy(max_attempts=2, backoff=0.2, factor=1.0, jitter=0.0, name="fast")


@define_job("cb.item", event="cb.item", retry_policy=FAST)
def item(event: Any, step: Any) -> Any:
    step.run("touch", lambda: record(event, "touch"))
    return event.data.get("i")


@define_job("cb.waiter", event="cb.order", retry_policy=FAST)
def waiter(event: Any, step: Any) -> Any:
    paid = step.wait_for_event("paid", event="cb.paid", match="data.order", timeout=60)
    return {"paid": paid is not None}


def _charge(event: Any) -> str:
    record(event, "charge")
    if not recorded("fixed", "charge"):  # the cause, until the test "fixes" it
        raise RuntimeError("card declined")
    return "ch_1"


@define_job("cb.fulfil", event="cb.order.paid", retry_policy=FAST)
def fulfil(event: Any, step: Any) -> Any:
    invoice = step.run("invoice", lambda: (record(event, "invoice"), "inv_1")[1])
    charge = step.run("charge", _charge, event)
    step.run("email", lambda: record(event, "email"))
    return {"invoice": invoice, "charge": charge}


@define_job("cb.child", event="cb.child.unused", retry_policy=FAST)
def child(event: Any, step: Any) -> Any:
    step.run("work", lambda: record(event, "work"))
    if event.data.get("fail"):
        raise NonRetriableError(f"child {event.data.get('n')} refused")
    return event.data["n"] * 2


@define_job("cb.sleepy", event="cb.sleepy.unused", retry_policy=FAST)
def sleepy(event: Any, step: Any) -> Any:
    step.sleep("nap", 120)
    return "woke"


@define_job("cb.parent", event="cb.parent", retry_policy=FAST)
def parent(event: Any, step: Any) -> Any:
    step.run("before", lambda: record(event, "before"))
    child_job = "cb.sleepy" if event.data.get("sleepy") else "cb.child"
    try:
        value = step.invoke("child", child_job, {"n": event.data["n"], "fail": event.data.get("fail")},
                            timeout=event.data.get("timeout"), detach=event.data.get("detach", False))
    except ChildFailed as failed:
        step.run("after", lambda: record(event, "after"))
        return {"failed": failed.error.get("message"), "state": failed.state}
    step.run("after", lambda: record(event, "after"))
    return {"child": value}


@define_job("cb.fan", event="cb.fan", retry_policy=FAST)
def fan(event: Any, step: Any) -> Any:
    record(event, "handler")  # every claim of the parent that reaches the handler
    n = event.data["n"]
    values = step.gather("kids", [("cb.child", {"n": i, "fail": i in event.data.get("fail", [])})
                                  for i in range(n)], return_exceptions=True)
    step.run("after", lambda: record(event, "after"))
    return {"sum": sum(v for v in values if isinstance(v, int)),
            "failed": [i for i, v in enumerate(values) if isinstance(v, ChildFailed)]}
