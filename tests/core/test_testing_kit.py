"""The test kit (motir_celery.testing) as a user writes with it: crashes after any step, skipped time,
eager mode — each test here is also the proof that the kit tells the truth.

Everything runs in this process against the session's real Postgres (the plugin's
``motir_database_url``), through the real claim, step, settle and sweeper statements.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from motir_celery import NonRetriableError, RetryPolicy, define_job
from motir_celery.adapter.celery_app import default_app
from motir_celery.core.producer.results import JobFailed
from motir_celery.testing import Motir

# --- a fake payment gateway and the jobs a team would write against it ---------------------


class Gateway:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def charge(self, order: int) -> dict[str, int]:
        self.calls.append(order)
        return {"charged": order}


gateway = Gateway()
sent: list[str] = []


@pytest.fixture(autouse=True)
def _fresh_fakes() -> None:
    gateway.calls.clear()
    sent.clear()


@define_job("kit.pay-order", retry_policy="idempotent")
def pay_order(step: Any, order: int) -> dict[str, int]:
    step.run("charge", gateway.charge, order)          # stored: never charged twice
    step.run("email", sent.append, f"receipt {order}")
    return {"paid": order}


@define_job("kit.pay-order-carelessly", retry_policy="idempotent")
def pay_order_carelessly(step: Any, order: int) -> dict[str, int]:
    gateway.charge(order)                               # outside step.run: runs again on every attempt
    step.run("charge", lambda: "recorded")
    step.run("email", sent.append, f"receipt {order}")
    return {"paid": order}


@define_job("kit.remind-tomorrow", retry_policy="none")
def remind_tomorrow(step: Any, user: int) -> str:
    step.sleep("a-day", 86400)
    step.run("remind", sent.append, f"reminder {user}")
    return "reminded"


HOURLY = RetryPolicy(max_attempts=4, backoff=600.0, factor=2.0, jitter=0.0, name="hourly")  # 10, 20, 40 min


@define_job("kit.flaky", retry_policy=HOURLY)
def flaky(step: Any, fail_times: int) -> int:
    if step.attempt <= fail_times:
        raise RuntimeError(f"attempt {step.attempt} fails")
    return step.attempt


@define_job("kit.refuses", retry_policy="idempotent")
def refuses(step: Any) -> None:
    raise NonRetriableError("no such customer")


@define_job("kit.order-flow", event="kit.order.placed", retry_policy="none")
def order_flow(event: Any, step: Any) -> Any:
    paid = step.wait_for_event("paid", event="kit.order.paid", match="data.order", timeout=3600)
    return "paid" if paid else "gave up"


@define_job("kit.nightly", cron="0 3 * * *", retry_policy="none")
def nightly(event: Any, step: Any) -> str:
    return str(event.data["scheduled_for"])


# --- crashes --------------------------------------------------------------------------------


def test_charge_is_stored_before_the_crash(motir: Motir) -> None:
    motir.crash_after("charge")     # the next attempt that stores "charge" dies right after it
    handle = motir.run(pay_order, 42)
    motir.drain()                   # attempt 1 dies after "charge"; attempt 2 resumes and finishes
    assert handle.get() == {"paid": 42}
    assert motir.steps(handle) == ["charge", "email"]
    assert gateway.calls == [42]
    assert motir.attempts(handle) == 2 and motir.outcomes_of(handle) == ["lost", "succeeded"]


def test_a_side_effect_outside_step_run_happens_again_after_a_crash(motir: Motir) -> None:
    motir.crash_after("charge")
    handle = motir.run(pay_order_carelessly, 7)
    motir.drain()
    assert handle.get() == {"paid": 7}
    assert gateway.calls == [7, 7]   # the kit caught the non-idempotent body: charged twice
    assert sent == ["receipt 7"]     # what sat in step.run ran once


def test_crash_before_a_step_runs_its_body_once_on_the_next_attempt(motir: Motir) -> None:
    motir.crash_before("email")
    handle = motir.run(pay_order, 5)
    motir.drain()
    assert handle.get() == {"paid": 5} and gateway.calls == [5] and sent == ["receipt 5"]
    assert motir.outcomes_of(handle) == ["lost", "succeeded"]


def test_a_crash_on_the_last_attempt_ends_in_the_dlq(motir: Motir) -> None:
    motir.crash_after("remind")      # remind_tomorrow has one attempt (retry_policy="none")
    handle = motir.run(remind_tomorrow, 1)
    motir.drain()
    motir.advance(days=1)
    motir.drain()                    # the sleep charged nothing: the attempt that dies is the first
    assert motir.state(handle) == "failed" and sent == ["reminder 1"]
    (entry,) = motir.dlq()
    assert entry["job_id"] == "kit.remind-tomorrow" and entry["failure"]["type"] == "LeaseExpired"


# --- time --------------------------------------------------------------------------------------


def test_a_day_of_sleep(motir: Motir) -> None:
    started = time.monotonic()
    handle = motir.run(remind_tomorrow, 7)
    motir.drain()                    # runs until step.sleep(86400) suspends it
    assert motir.state(handle) == "queued" and sent == []
    motir.advance(hours=23)
    motir.drain()
    assert sent == []                # an hour early: still asleep
    motir.advance(seconds=3600)
    motir.drain()
    assert handle.get() == "reminded" and sent == ["reminder 7"]
    took = time.monotonic() - started
    print(f"\n24 h of step.sleep tested in {took * 1000:.0f} ms")  # ~0.1 s here when the machine is quiet
    assert took < 60  # measured, not asserted (a loaded machine): it only must not have slept


def test_a_retry_schedule_of_an_hour(motir: Motir) -> None:
    started = time.monotonic()
    handle = motir.run(flaky, 3)     # fails 3 times: retried after 10, 20 and 40 minutes
    motir.drain()
    for minutes in (10, 20, 40):
        assert motir.state(handle) == "queued"
        motir.advance(minutes=minutes - 1)
        motir.drain()
        assert motir.attempts(handle) == {10: 1, 20: 2, 40: 3}[minutes]   # not due yet
        motir.advance(minutes=1)
        motir.drain()
    assert handle.get() == 4
    assert motir.outcomes_of(handle) == ["retrying", "retrying", "retrying", "succeeded"]
    took = time.monotonic() - started
    print(f"\n70 minutes of retries tested in {took * 1000:.0f} ms")  # ~0.2 s here when the machine is quiet
    assert took < 60  # measured, not asserted: it only must not have waited out the backoff


def test_a_countdown_is_honoured_and_skipped(motir: Motir) -> None:
    handle = motir.apply_async(pay_order, [3], countdown=300)
    motir.drain()
    assert motir.state(handle) == "queued" and gateway.calls == []
    motir.advance(seconds=300)
    motir.drain()
    assert handle.get() == {"paid": 3}


def test_a_wait_times_out_or_is_answered(motir: Motir) -> None:
    waiting = motir.handles(motir.send_event("kit.order.placed", {"order": 1}))
    answered = motir.handles(motir.send_event("kit.order.placed", {"order": 2}))
    motir.drain()
    motir.send_event("kit.order.paid", {"order": 2})   # wakes order 2's run
    motir.drain()
    assert answered[0].get() == "paid"
    assert motir.state(waiting[0]) == "queued"
    motir.advance(hours=1)
    motir.drain()
    assert waiting[0].get() == "gave up"


def test_cron_slots_follow_the_kits_clock(motir: Motir) -> None:
    first = motir.tick(nightly)
    assert len(first) == 1 and motir.tick(nightly) == []   # one run per slot, however often the beat ticks
    motir.advance(days=1)
    second = motir.tick(nightly)
    motir.drain()
    assert len(second) == 1 and second != first


# --- reading what happened --------------------------------------------------------------------


def test_a_non_retriable_error_goes_straight_to_the_dlq(motir: Motir) -> None:
    handle = motir.run(refuses)
    motir.drain()
    with pytest.raises(JobFailed, match="no such customer"):
        handle.get()
    assert motir.attempts(handle) == 1 and [e["failure"]["message"] for e in motir.dlq()] == ["no such customer"]


def test_get_on_a_run_not_finished_says_so_at_once(motir: Motir) -> None:
    handle = motir.run(pay_order, 9)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not finished .*motir.drain\(\)"):
        handle.get()
    assert time.monotonic() - started < 0.5


# --- Celery's eager mode ------------------------------------------------------------------------


@pytest.fixture
def eager() -> Any:
    """Celery's eager mode on the engine's app (CELERY_TASK_ALWAYS_EAGER in a Django project)."""
    conf = default_app().conf
    conf.task_always_eager = True
    yield conf
    conf.task_always_eager = False


def test_eager_mode_runs_a_delay_at_once_through_the_engine(motir: Motir, eager: Any) -> None:
    from motir_celery import current_engine

    assert current_engine() is motir.engine  # building the app (the fixture) left the kit's engine current
    handle = pay_order.delay(11)
    assert handle.get(timeout=0) == {"paid": 11}      # ran before delay() returned
    assert motir.steps(handle) == ["charge", "email"] and gateway.calls == [11]
    again = pay_order.apply_async([11], task_id="order-11")
    same = pay_order.apply_async([11], task_id="order-11")
    assert same.deduplicated and same.id == again.id and gateway.calls == [11, 11]   # a key is a key, eager or not


# --- no cost on the production path -----------------------------------------------------------


def test_the_kits_clock_and_crashes_leave_the_production_path_as_it_was(motir: Motir) -> None:
    """``advance`` moves the instants the engine stored; it adds no clock to a statement: every
    statement of the worker's path reads the database's ``now()`` and nothing of the kit's, and
    none is changed by a test that skips time and crashes. The crashes are the kit engine's
    ``faults``: no class is patched, and once the fixture is gone the current engine injects none."""
    from motir_celery.core.current import current
    from motir_celery.core.worker.steps import Step
    from motir_celery.store.driver import Statement
    from motir_celery.store.sql import testing as testing_sql
    from motir_celery.store.sql import worker as worker_sql

    hot = {name: s.sql for name, s in vars(worker_sql).items() if isinstance(s, Statement)}
    kit_names = [s.name for s in vars(testing_sql).values() if isinstance(s, Statement)]
    assert {"CLAIM", "STORE_STEP", "SETTLE_SUCCEEDED", "SETTLE_RETRY", "SETTLE_FAILED"} <= set(hot)
    for name, sql in hot.items():
        assert "motir.now" not in sql and "clock_timestamp" not in sql, name
        assert not any(k in sql for k in kit_names), name
    motir.crash_after("charge")
    handle = motir.run(pay_order, 7)
    motir.drain()
    motir.advance(seconds=3600)
    motir.drain()
    assert handle.get() == {"paid": 7}
    assert {name: s.sql for name, s in vars(worker_sql).items() if isinstance(s, Statement)} == hot
    motir.uninstall()
    assert (Step.run.__qualname__, Step.record.__qualname__) == ("Step.run", "Step.record")
    assert current() is not motir.engine and current().faults is None
