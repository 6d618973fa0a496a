"""Batch send vs single sends, in one run (issue 20): ``python -m bench.batch_send``.

One client, one job subscribing to the event. Side A: ``send_event`` calls/s; side B:
``send_events`` batches of ``--batch`` (100) events, in events/s. Both publish every run
to the broker (a throwaway queue, purged after) as a producer does, the batch through
``adapter/batch_publish.py`` (one pipelined round trip on Redis); ``--no-publish``
measures the database side alone. No worker runs. The sides take turns in rounds.
"""

from __future__ import annotations

from typing import Any

from bench import harness as h
from motir_celery import define_job
from motir_celery.adapter.batch_publish import publish_many
from motir_celery.adapter.celery_app import create_app, publisher
from motir_celery.core.producer.batch import send_events
from motir_celery.core.producer.events import send_event
from motir_celery.settings import Settings
from motir_celery.store.db import dispose_engines

QUEUE, JOB = "bench-batch-send", "bench.batch-item"


def _item(event: Any, step: Any) -> None:
    return None


def main() -> None:
    parser = h.parser("bench.batch_send", __doc__, write=None)
    parser.add_argument("--events", type=int, default=2000, help="events per side per round")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-publish", action="store_true")
    args = parser.parse_args()
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    with h.Database.create("motir_bench_batch") as db:
        h.use_engine(db.url, QUEUE, imports="")
        define_job(JOB, event=JOB)(_item)
        app = create_app(Settings.from_env())
        publish = None if args.no_publish else publisher(app)
        many = None if args.no_publish else publish_many(app)

        def data(i: int) -> dict[str, Any]:
            return {"i": i, "workspace_id": "acme"}

        def single() -> float:
            return args.events / sum(h.timed(lambda i: send_event(JOB, data(i), publish=publish), args.events))

        def batched() -> float:
            return args.events / sum(h.timed(lambda b: send_events(
                [(JOB, data(i)) for i in range(b * args.batch, min((b + 1) * args.batch, args.events))],
                publish=publish, publish_many=many), -(-args.events // args.batch)))

        try:
            send_event(JOB, {"warm": 1}, publish=publish)
            send_events([(JOB, {"warm": 1})] * 2, publish=publish, publish_many=many)
            rounds = h.interleave({"send_event": single, f"send_events batch={args.batch}": batched}, args.rounds,
                                  print, lambda v: f"{v:.0f} events/s")
        finally:
            h.purge_queue(QUEUE)
            dispose_engines()
    print(f"events/s, median of {args.rounds} rounds of {args.events} ({'database only' if args.no_publish else 'with publish'}):")
    h.report(rounds, "send_event", "events/s", digits=0)
    print("  (the issue wants the batch >= 5x)")


if __name__ == "__main__":
    main()
