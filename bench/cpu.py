"""CPU per run: where a durable run's cost goes, by process, for each engine variant.

On a shared 2-core machine wall-clock rates swing by 2x between rounds; CPU
seconds spent per run move far less, so this section is the steady way to
compare engine variants (before/after, task events, async step commit).

One worker (prefork, concurrency 2) per variant; after 100 warm-up runs,
``runs`` more are queued and drained while the CPU time (user + system) of the
worker's main process, of its pool children and of the Postgres backends
serving the bench database is read from the kernel before and after. Plain
Celery (the same three functions in one task, no database) is measured the
same way, as the floor. The Redis server's CPU is counted on neither side.
"""

from __future__ import annotations

from typing import Any

import psutil

from bench.common import DB, MOTIR_QUEUE, PLAIN_QUEUE, celery_workers, child_env, purge, succeeded, truncate, wait_for


def _postgres_cpu() -> float:
    total = 0.0
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if "postgres" in (p.info["name"] or "") and f" {DB} " in " ".join(p.info["cmdline"] or []) + " ":
                c = p.cpu_times()
                total += c.user + c.system
        except psutil.Error:
            continue
    return total


def _worker_cpu(pid: int) -> tuple[float, float]:
    main = psutil.Process(pid)
    m = main.cpu_times()
    children = 0.0
    for p in main.children(recursive=True):
        c = p.cpu_times()
        children += c.user + c.system
    return m.user + m.system, children


def _one(url: str, runs: int, app: str, env: dict[str, str] | None) -> dict[str, float]:
    from bench.throughput import prequeue_motir
    from motir_celery.adapter.celery_app import default_app

    truncate(url)
    purge(default_app(), MOTIR_QUEUE)
    with celery_workers(app, MOTIR_QUEUE, 1, 2, env, tag="cpu") as procs:
        prequeue_motir(url, 100)
        wait_for(lambda: succeeded(url) >= 100, procs, timeout=300, tag="cpu")
        m0, c0 = _worker_cpu(procs[0].pid)
        p0 = _postgres_cpu()
        prequeue_motir(url, runs)
        wait_for(lambda: succeeded(url) >= runs + 100, procs, timeout=900, tag="cpu", poll=0.1)
        m1, c1 = _worker_cpu(procs[0].pid)
        p1 = _postgres_cpu()
    out = {"main_ms": (m1 - m0) / runs * 1e3, "children_ms": (c1 - c0) / runs * 1e3,
           "postgres_ms": (p1 - p0) / runs * 1e3}
    out["total_ms"] = sum(out.values())
    return out


def _plain(runs: int) -> dict[str, float]:
    import uuid

    from bench.plain_app import app
    from bench.throughput import _redis

    r, key = _redis(), f"bench-plain-cpu-{uuid.uuid4().hex}"
    purge(app, PLAIN_QUEUE)
    try:
        with celery_workers("bench.plain_app", PLAIN_QUEUE, 1, 2, tag="cpu-plain") as procs:
            for i in range(100):
                app.send_task("bench.plain", args=[i, key], queue=PLAIN_QUEUE)
            wait_for(lambda: r.hlen(key) >= 100, procs, timeout=300, tag="cpu-plain")
            m0, c0 = _worker_cpu(procs[0].pid)
            for i in range(100, runs + 100):
                app.send_task("bench.plain", args=[i, key], queue=PLAIN_QUEUE)
            wait_for(lambda: r.hlen(key) >= runs + 100, procs, timeout=900, tag="cpu-plain", poll=0.1)
            m1, c1 = _worker_cpu(procs[0].pid)
    finally:
        r.delete(key)
    out = {"main_ms": (m1 - m0) / runs * 1e3, "children_ms": (c1 - c0) / runs * 1e3, "postgres_ms": 0.0}
    out["total_ms"] = sum(out.values())
    return out


def measure(url: str, variants: dict[str, tuple[str | None, str, dict[str, str]]], runs: int = 1000,
            rounds: int = 2, engine_at: Any = None) -> dict[str, Any]:
    """``variants``: label -> (engine path or None, celery app, extra env); the
    label ``plain`` measures plain Celery instead."""
    from bench.stats import median

    samples: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
    for _ in range(rounds):
        for label, (path, app, extra) in variants.items():
            if label == "plain":
                samples[label].append(_plain(runs))
                continue
            with engine_at(path):
                samples[label].append(_one(url, runs, app, child_env(**extra)))
    return {"runs": runs, "rounds": rounds,
            "variants": {k: {m: median([s[m] for s in v]) for m in v[0]} for k, v in samples.items()}}
