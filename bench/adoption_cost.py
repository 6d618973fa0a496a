"""What a run adopted from a message in Celery's own protocol costs, against a run ``.delay()`` made.

    python -m bench.adoption_cost [--runs 400] [--rounds 3]

In one process, no broker (issue 26's bound: adoption costs at most one more statement):

* ``.delay()``: the producer's write (``job.delay(2, 3)``, its publish only noting the run),
  then the worker's side, ``runner.execute`` — claim, one step, settle;
* adopted: what a worker does with ``send_task("<task>", (2, 3))``'s message —
  ``protocol.run_to_execute`` (the adoption: the same ``DIRECT_RUN`` statement, keyed on
  the task id) — then the same ``runner.execute``;
* a copy of an adopted message (same task id): the adoption finds the run taken, then the
  claim refuses it.

Statements are counted at the driver (every ``execute`` psycopg sends for the engine: the
pool's pre-ping and the schema probe too), per run; time is per run, the variants taking
turns in rounds. A fresh database (``motir_bench_adoption``) is made and dropped.
"""

from __future__ import annotations

import statistics
import uuid
from types import SimpleNamespace
from typing import Any, Callable

import psycopg

from bench import harness as h

QUEUE = "bench-adoption"


class Counter:
    """Counts ``psycopg.Cursor.execute`` calls in this process while installed."""

    def __init__(self) -> None:
        self.n = 0
        self._real = psycopg.Cursor.execute

    def __enter__(self) -> "Counter":
        real, counter = self._real, self

        def counting(cursor: Any, *args: Any, **kwargs: Any) -> Any:
            counter.n += 1
            return real(cursor, *args, **kwargs)

        psycopg.Cursor.execute = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        psycopg.Cursor.execute = self._real  # type: ignore[method-assign]


def main() -> None:
    parser = h.parser("bench.adoption_cost", __doc__, write=None)
    parser.add_argument("--runs", type=int, default=400, help="runs per variant (default 400)")
    parser.add_argument("--rounds", type=int, default=3, help="turns the variants take (default 3)")
    opts = parser.parse_args()
    h.need("MOTIR_DATABASE_URL")
    with h.Database.create("motir_bench_adoption") as db:
        h.use_engine(db.url, QUEUE, imports="")
        from motir_celery import define_job
        from motir_celery.adapter.protocol import run_to_execute
        from motir_celery.core.worker.runner import execute

        @define_job("bench.adoption.add", retry_policy="none")
        def add(step: Any, x: int, y: int) -> int:
            return step.run("add", lambda: x + y)  # type: ignore[no-any-return]

        def message(task_id: str) -> Any:
            """Celery's request of a plain message ``send_task(name, (2, 3))`` (protocol 2)."""
            return SimpleNamespace(id=task_id, task=add.task_name, argsrepr="(2, 3)", kwargsrepr="{}")

        published: list[uuid.UUID] = []
        from motir_celery.core.producer import direct

        def delayed(_: int) -> None:
            handle = direct.apply_async(add, (2, 3), {}, {}, publish_for=lambda q, p: lambda r, j, c=0.0: published.append(r))
            assert execute(handle.id, job_id=add.id, worker="bench").state == "succeeded"  # type: ignore[arg-type]

        adopted_ids: list[str] = []

        def adopted(_: int) -> None:
            task_id = str(uuid.uuid4())
            run_id = run_to_execute(message(task_id), add, (2, 3), {})
            assert run_id == task_id and execute(run_id, job_id=add.id, worker="bench").state == "succeeded"
            adopted_ids.append(task_id)

        def copy(i: int) -> None:
            task_id = adopted_ids[i % len(adopted_ids)]
            run_id = run_to_execute(message(task_id), add, (2, 3), {})
            assert run_id == task_id and execute(run_id, job_id=add.id, worker="bench").state == "skipped"

        variants: dict[str, Callable[[int], None]] = {".delay() + run": delayed, "adopted + run": adopted,
                                                      "a copy of an adopted message": copy}
        for fn in variants.values():  # warm: pool, schema probe, plans
            fn(0)
        n = max(1, opts.runs // opts.rounds)
        statements: dict[str, list[float]] = {name: [] for name in variants}

        def measure(name: str) -> list[float]:
            with Counter() as counter:
                times = h.timed(variants[name], n)
            statements[name].append(counter.n / n)
            return times

        rounds = h.interleave({name: (lambda name=name: measure(name)) for name in variants}, opts.rounds,
                              show=lambda ts: f"{statistics.median(ts) * 1000:.2f} ms median")
        print(f"\n{h.machine(db.url, load=True)}; {n} runs a round; {h.command('bench.adoption_cost')}")
        print("statements per run (the driver's executes):")
        for name, counts in statements.items():
            print(f"  {name:<30} {statistics.median(counts):5.2f}  (rounds: {', '.join(f'{c:.2f}' for c in counts)})")
        print("time per run, ms:")
        h.report({name: [statistics.median(ts) for ts in r] for name, r in rounds.items()},
                 baseline=".delay() + run", unit="ms", scale=1000, digits=2)
        extra = statistics.median(statements["adopted + run"]) - statistics.median(statements[".delay() + run"])
        print(f"adoption costs {extra:+.2f} statements per run against .delay() (bound: at most +1)")
        assert extra <= 1, "adoption must cost at most one more statement than .delay()"


if __name__ == "__main__":
    main()
