"""Batch send vs single sends, in one run (issue 20): ``python -m bench.batch_send``.

One client, one job subscribing to the event. Side A: ``send_event`` calls/s; side B:
``send_events`` batches of ``--batch`` (100) events, in events/s; the ratio is printed.
Both publish every run to the broker (``CELERY_BROKER_URL``, a throwaway queue that is
purged after), as a producer does — the batch through ``adapter/batch_publish.py`` (one
pipelined round trip on Redis), as ``motir_celery.send_events`` does; ``--no-publish`` measures the database side alone.
No worker runs: this measures the producer. The sides alternate in rounds so that a
neighbour's load on a shared machine falls on both. Not part of any pass/fail.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.common import create_bench_database, drop_database


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=2000, help="events per side per round")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-publish", action="store_true")
    args = parser.parse_args()

    os.environ.setdefault("BENCH_SERVER_URL", os.environ["MOTIR_DATABASE_URL"])
    url = create_bench_database("motir_bench_batch")
    os.environ["MOTIR_DATABASE_URL"] = url
    os.environ["MOTIR_QUEUE"] = "bench-batch-send"
    from motir_celery import define_job
    from motir_celery.adapter.batch_publish import publish_many
    from motir_celery.adapter.celery_app import create_app, publisher
    from motir_celery.core.producer.batch import send_events
    from motir_celery.core.producer.events import send_event
    from motir_celery.settings import Settings, reset_settings
    from motir_celery.store.db import dispose_engines

    reset_settings()

    @define_job("bench.batch-item", event="bench.batch-item")
    def _item(event, step):  # type: ignore[no-untyped-def]
        return None

    app = create_app(Settings.from_env())
    publish = None if args.no_publish else publisher(app)
    many = None if args.no_publish else publish_many(app)
    single, batched = [], []
    try:
        send_event("bench.batch-item", {"warm": 1}, publish=publish)
        send_events([("bench.batch-item", {"warm": 1})] * 2, publish=publish, publish_many=many)
        for r in range(args.rounds):
            t0 = time.perf_counter()
            for i in range(args.events):
                send_event("bench.batch-item", {"i": i, "round": r, "workspace_id": "acme"}, publish=publish)
            single.append(args.events / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for b in range(0, args.events, args.batch):
                send_events([("bench.batch-item", {"i": i, "round": r, "workspace_id": "acme"})
                             for i in range(b, min(b + args.batch, args.events))],
                            publish=publish, publish_many=many)
            batched.append(args.events / (time.perf_counter() - t0))
            print(f"round {r + 1}: send_event {single[-1]:.0f} calls/s, send_events {batched[-1]:.0f} events/s",
                  flush=True)
    finally:
        if publish is not None:
            with app.connection_for_write() as conn:
                conn.default_channel.queue_purge("bench-batch-send")
        dispose_engines()
        drop_database("motir_bench_batch")
    s, b = statistics.median(single), statistics.median(batched)
    side = "database only" if args.no_publish else "with publish"
    print(f"send_event           : {s:8.0f} calls/s   (median of {args.rounds} rounds of {args.events}; {side})")
    print(f"send_events batch={args.batch:<3}: {b:8.0f} events/s  (median of {args.rounds} rounds)")
    print(f"ratio                : {b / s:8.1f}x  (the issue wants >= 5x)")


if __name__ == "__main__":
    main()
