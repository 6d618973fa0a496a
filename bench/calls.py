"""What single calls cost, no worker running; the variants of each section take turns in rounds.

    python -m bench.calls [--only delay,batch,adoption] [--rounds 3]

``delay``: ``job.delay()`` (and ``apply_async(task_id=)``, ``await delay_async()``) against Celery's
``task.delay()``, per call. ``batch`` (issue 20): ``send_events`` batches against ``send_event`` calls,
events/s. ``adoption`` (issue 26: at most one more statement): a run adopted from a Celery-protocol
message, and a copy of it, against a ``.delay()``-made run: the driver's executes and time per run.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import psycopg

from bench import harness as h

QUEUE, PLAIN_QUEUE = "bench-calls", "bench-calls-plain"
SECTIONS = ("delay", "batch", "adoption")


def delay(db: h.Database, args: Any) -> None:
    from celery import Celery

    from motir_celery import define_job

    plain = Celery("bench_plain", broker=os.environ["CELERY_BROKER_URL"], set_as_current=False)
    plain.conf.update(task_default_queue=PLAIN_QUEUE, task_ignore_result=True)

    @plain.task(name="bench.plain.noop")
    def noop(order_id: int) -> None: ...

    @define_job("bench.delay.noop", retry_policy="none")
    def durable(step: Any, order_id: int) -> None: ...

    async def delay_async(calls: int) -> list[float]:
        out = []
        for i in range(calls):
            t0 = time.perf_counter()
            await durable.delay_async(i)
            out.append(time.perf_counter() - t0)
        return out

    n = max(1, args.calls // args.rounds)
    variants: dict[str, Callable[[], list[float]]] = {
        "celery task.delay()": lambda: h.timed(lambda i: noop.delay(i), n),
        "motir job.delay()": lambda: h.timed(lambda i: durable.delay(i), n),
        "motir job.apply_async(task_id=)": lambda: h.timed(
            lambda i: durable.apply_async(args=[i], task_id=str(uuid.uuid4())), n),
        "motir await job.delay_async()": lambda: asyncio.run(delay_async(n)),
    }
    for warm in variants.values():  # connections, the Redis lane's plan, imports
        warm()
    rounds = h.interleave(variants, args.rounds)
    print(f"per-call cost, median of {n * args.rounds} calls each ({args.rounds} rounds), us; p99 "
          + ", ".join(f"{k} {h.percentile([x for r in rs for x in r], 99) * 1e6:.0f}" for k, rs in rounds.items()))
    h.report({k: [h.median(r) for r in rs] for k, rs in rounds.items()}, "celery task.delay()", "us", 1e6, 0)


def _item(event: Any, step: Any) -> None:
    return None


def batch(db: h.Database, args: Any) -> None:
    from motir_celery import current_engine, define_job

    job = "bench.batch-item"
    define_job(job, event=job)(_item)
    engine = h.held() if args.no_publish else current_engine()

    def single() -> float:
        return args.events / sum(h.timed(lambda i: engine.send_event(job, {"i": i, "workspace_id": "acme"}),
                                         args.events))

    def batched() -> float:
        return args.events / sum(h.timed(lambda b: engine.send_events(
            [(job, {"i": i, "workspace_id": "acme"}) for i in range(b * args.batch, min((b + 1) * args.batch, args.events))]),
            -(-args.events // args.batch)))

    engine.send_event(job, {"warm": 1})
    engine.send_events([(job, {"warm": 1})] * 2)
    rounds = h.interleave({"send_event": single, f"send_events batch={args.batch}": batched}, args.rounds,
                          print, lambda v: f"{v:.0f} events/s")
    print(f"events/s, median of {args.rounds} rounds of {args.events} "
          f"({'database only' if args.no_publish else 'with publish'}):")
    h.report(rounds, "send_event", "events/s", digits=0)
    print("  (the issue wants the batch >= 5x)")


@contextmanager
def counting() -> Iterator[list[int]]:
    """``[n]``: the statements this process sent meanwhile: ``psycopg.Cursor.execute`` calls and
    the per-step statements the driver sends through libpq itself (``driver.through_libpq_prepared``)."""
    from motir_celery.store import driver

    real, real_libpq, n = psycopg.Cursor.execute, driver.through_libpq_prepared, [0]

    def execute(cursor: Any, *a: Any, **kw: Any) -> Any:
        n[0] += 1
        return real(cursor, *a, **kw)

    def through_libpq(*a: Any, **kw: Any) -> Any:
        found = real_libpq(*a, **kw)
        n[0] += found is not None  # None: the cursor sends it (counted there)
        return found

    psycopg.Cursor.execute = execute  # type: ignore[method-assign]
    setattr(driver, "through_libpq_prepared", through_libpq)
    try:
        yield n
    finally:
        psycopg.Cursor.execute = real  # type: ignore[method-assign]
        setattr(driver, "through_libpq_prepared", real_libpq)


def adoption(db: h.Database, args: Any) -> None:
    from motir_celery import define_job
    from motir_celery.adapter.protocol import run_to_execute

    @define_job("bench.adoption.add", retry_policy="none")
    def add(step: Any, x: int, y: int) -> int:
        return step.run("add", lambda: x + y)  # type: ignore[no-any-return]

    engine = h.held()  # no broker: each run executed here

    def adopt(task_id: str) -> str:
        """What a worker does with Celery's request of ``send_task(name, (2, 3))`` (protocol 2)."""
        message = SimpleNamespace(id=task_id, task=add.task_name, argsrepr="(2, 3)", kwargsrepr="{}")
        run_id = run_to_execute(engine, message, add, (2, 3), {})
        assert run_id == task_id
        return engine.execute(run_id, job_id=add.id, worker="bench").state

    def delayed(_: int) -> None:
        handle = engine.apply_async(add, (2, 3), {}, {})
        assert engine.execute(handle.id, job_id=add.id, worker="bench").state == "succeeded"  # type: ignore[arg-type]

    adopted: list[str] = []

    def fresh(_: int) -> None:
        adopted.append(str(uuid.uuid4()))
        assert adopt(adopted[-1]) == "succeeded"

    def copy(i: int) -> None:
        assert adopt(adopted[i % len(adopted)]) == "skipped"

    variants = {".delay() + run": delayed, "adopted + run": fresh, "a copy of an adopted message": copy}
    for fn in variants.values():  # warm: pool, schema probe, plans
        fn(0)
    n, statements = max(1, args.runs // args.rounds), {name: [] for name in variants}  # type: ignore[var-annotated]

    def measure(name: str) -> list[float]:
        with counting() as calls:
            times = h.timed(variants[name], n)
        statements[name].append(calls[0] / n)
        return times

    rounds = h.interleave({name: (lambda name=name: measure(name)) for name in variants}, args.rounds,
                          show=lambda ts: f"{h.median(ts) * 1000:.2f} ms median")
    print(f"{n} runs a round; statements per run (the driver's executes):")
    for name, counts in statements.items():
        print(f"  {name:<30} {h.median(counts):5.2f}  (rounds: {', '.join(f'{c:.2f}' for c in counts)})")
    print("time per run, ms:")
    h.report({name: [h.median(ts) for ts in r] for name, r in rounds.items()}, ".delay() + run", "ms", 1000, 2)
    extra = h.median(statements["adopted + run"]) - h.median(statements[".delay() + run"])
    print(f"adoption costs {extra:+.2f} statements per run against .delay() (bound: at most +1)")
    assert extra <= 1, "adoption must cost at most one more statement than .delay()"


def main() -> None:
    parser = h.parser("bench.calls", __doc__, write=None)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    parser.add_argument("--rounds", type=int, default=3, help="turns the variants take (default 3)")
    parser.add_argument("--calls", type=int, default=2000, help="delay: calls per variant in all (default 2000)")
    parser.add_argument("--events", type=int, default=2000, help="batch: events per side per round (default 2000)")
    parser.add_argument("--batch", type=int, default=100, help="batch: events per send_events call (default 100)")
    parser.add_argument("--no-publish", action="store_true", help="batch: the database side alone")
    parser.add_argument("--runs", type=int, default=400, help="adoption: runs per variant in all (default 400)")
    args = parser.parse_args()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}")
    broker = bool({"delay", "batch"} & set(sections))
    h.need("MOTIR_DATABASE_URL", *(["CELERY_BROKER_URL"] if broker else []))
    from motir_celery.store.db import dispose_engines

    with h.Database.create("motir_bench_calls") as db:
        h.use_engine(db.url, QUEUE, imports="")
        print(f"{h.machine(db.url, load=True)}; {h.command('bench.calls')}")
        try:
            for name in sections:
                print(f"\n--- {name}", flush=True)
                globals()[name](db, args)
        finally:
            if broker:
                h.purge_queue(QUEUE)
                h.purge_queue(PLAIN_QUEUE)
            dispose_engines()


if __name__ == "__main__":
    main()
