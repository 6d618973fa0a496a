"""Memory: RSS of one worker (prefork, concurrency 2) after 1k and after 10k runs.

One worker lives through the whole section; runs are queued in batches and
drained, and after each checkpoint the RSS (VmRSS) and peak (VmHWM) of the
worker's main process and of its pool children are read from /proc. The pool
children are the processes that run the jobs; growth is theirs, last
checkpoint over first.
"""

from __future__ import annotations

from typing import Any

from bench.common import MOTIR_QUEUE, celery_workers, purge, rss_tree, succeeded, truncate, wait_for
from bench.throughput import prequeue_motir


def measure(url: str, checkpoints: tuple[int, ...] = (1000, 10000), concurrency: int = 2) -> dict[str, Any]:
    from motir_celery.adapter.celery_app import default_app

    truncate(url)
    purge(default_app(), MOTIR_QUEUE)
    samples = []
    with celery_workers("motir_celery", MOTIR_QUEUE, 1, concurrency, tag="motir-mem") as procs:
        done = 0
        for target in checkpoints:
            # Queue in slices so the table never holds more than one slice of queued rows.
            while done < target:
                batch = min(2000, target - done)
                prequeue_motir(url, batch)
                done += batch
                wait_for(lambda: succeeded(url) >= done, procs, timeout=900, tag="motir-mem", poll=0.25)
            tree = rss_tree(procs[0].pid)
            main, children = tree[0], tree[1:]
            samples.append({
                "runs": target,
                "main_rss_kb": main[1],
                "child_rss_kb": max(c[1] for c in children),
                "child_hwm_kb": max(c[2] for c in children),
            })
    truncate(url)
    first, last = samples[0], samples[-1]
    return {"samples": samples, "growth": last["child_rss_kb"] / first["child_rss_kb"] - 1,
            "main_growth": last["main_rss_kb"] / first["main_rss_kb"] - 1}
