"""Per-second cron jobs of the three-beats scenario.

Imported only by that scenario's beat and worker subprocesses
(``MOTIR_IMPORTS=tests.chaos.jobs,tests.chaos.cron_jobs``), never by the pytest
process: a cron job in the registry of a process that runs a scheduler of its
own (tests/adapter/test_beat.py) would be ticked there too.
"""

from __future__ import annotations

from typing import Any

from motir_celery import define_job

from .jobs import PATIENT, recorded_body

#: Every second, catch-up over the last 30 s: each beat inserts every slot it
#: has not seen answered, so three beats race on every slot, and a beat that
#: was late, restarted or cut off from Postgres fills the gap — a missing second
#: is a lost run. (30 s, not less: a beat whose pass fails retries 5 s later, so
#: a Postgres outage of a few seconds plus two failed passes is ~10 s; slots
#: older than the window are skipped by design.)
TICK = "chaos.tick"
#: Every second, overlap="skip", a run takes ~1.5 s: most slots are skipped
#: (recorded as cancelled rows) while one run is active; still one row per slot.
TICK_SKIP = "chaos.tick-skip"


@define_job(TICK, cron="* * * * * *", catchup=30, retry_policy=PATIENT)
def tick(event: Any, step: Any) -> Any:
    return step.run("tick", recorded_body, event, "tick", event.data["scheduled_for"])


@define_job(TICK_SKIP, cron="* * * * * *", overlap="skip", retry_policy=PATIENT)
def tick_skip(event: Any, step: Any) -> Any:
    return step.run("tick", recorded_body, event, "tick", event.data["scheduled_for"], 1.5)
