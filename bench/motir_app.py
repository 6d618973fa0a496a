"""The engine's app as the benches run it, with what a comparison row changes: ``celery -A bench.motir_app worker``.

``BENCH_TUNING``: the bench's own variable (the package reads no such name), comma-separated
``mechanism=0|1`` for the engine this app is built with (``bench.ablation``): the fields of
``Tuning`` (core/engine.py: ``claim_async_commit``, ``settle_async_commit``, ``direct_publish``,
``redis_ack_emulation``) and ``prepared_statements`` (``0``: the engine's settings with server-side
prepared statements off and no pooler probe). Unset: the engine's defaults, as ``celery -A
motir_celery`` has them. A process that imports this module publishes through that engine too
(it is made current), so a sender and its workers share one tuning.

``BENCH_TASK_EVENTS=1``: task events on, as while Flower watches (``attach()`` leaves them off,
as Celery does).
"""

from __future__ import annotations

import dataclasses
import os

from motir_celery import Engine
from motir_celery.adapter.celery_app import create_app
from motir_celery.core.engine import Tuning
from motir_celery.settings import Settings

FIELDS = {f.name for f in dataclasses.fields(Tuning)} | {"prepared_statements"}


def tuning_of(text: str) -> dict[str, bool]:
    """``BENCH_TUNING``'s text as {mechanism: on}."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in FIELDS or value not in ("0", "1"):
            raise SystemExit(f"BENCH_TUNING: {item!r} is not one of {sorted(FIELDS)} set to 0 or 1")
        out[name] = value == "1"
    return out


def engine(text: str = "") -> Engine:
    """An engine on this environment's settings, with ``text``'s mechanisms (``BENCH_TUNING``)."""
    chosen = tuning_of(text)
    settings: Settings | None = None
    if chosen.pop("prepared_statements", True) is False:
        settings = dataclasses.replace(Settings.from_env(), prepared_statements=False, detect_pooler=False)
    return Engine(settings, tuning=Tuning(**chosen))


app = create_app(engine=engine(os.environ.get("BENCH_TUNING", "")))
if os.environ.get("BENCH_TASK_EVENTS") == "1":
    app.conf.worker_send_task_events = True
    app.conf.task_send_sent_event = True
