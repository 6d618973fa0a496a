"""debounce= and batch= at send: a new run is folded into its key's open run, in the sender's transaction.

The event writers (``motir_record_event`` and its batch twin) write an event's runs as for
any job; for the runs of a job with debounce= or batch=, ``gather_runs`` then calls
``motir_gather`` in the same transaction, which under the key's advisory lock either opens
the key's gathering with the new run (run_at set to the end of its quiet period or batch
timeout) or deletes the new run and gives its event to the open one — debounce: as its
latest event, its run_at moved to a quiet period from now (never past max_wait after the
burst's first event); batch: appended to its list, due at once when full. So concurrent
senders of one key make one run. Events with no such subscriber cost one pass over their
runs in Python, no statement.

The result stays one entry per subscribing job: ``Queued`` for a run to publish now (the
one that opened, or a batch just filled), ``Gathered(run_id)`` for an event that joined a
run already set to come.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.core.jobs import Job, find_job
from motir_celery.core.runspec import gather_of
from motir_celery.store import records
from motir_celery.store.sql import flow as flow_sql

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

__all__ = ["gathers", "gather_runs"]

Runs = list[records.Queued | records.AlreadyQueued]


def gathers(jobs: Sequence[Job]) -> bool:
    """Whether any of these jobs gathers its events (the caller then writes in one transaction)."""
    return any(job.run_options.gathers for job in jobs)


def gather_runs(conn: Conn, runs: Sequence[records.Queued | records.AlreadyQueued], data: Any,
                workspace_id: str | None) -> Runs:
    """``runs`` of one event, with those of debounce / batch jobs gathered (in ``conn``'s transaction)."""
    todo = []
    for run in runs:
        job = find_job(run.job_id) if isinstance(run, records.Queued) else None
        spec = gather_of(job.run_options, data, workspace_id) if job is not None else None
        if spec is not None:
            assert isinstance(run, records.Queued)
            todo.append((run.run_id, spec.kind, spec.key, spec.wait, spec.limit))
    if not todo:
        return list(runs)
    found = {r["run_id"]: r for r in flow_sql.gather(conn, todo)}
    out: Runs = []
    for run in runs:
        row = found.get(run.run_id) if isinstance(run, records.Queued) else None
        if row is None:
            out.append(run)
        elif row["into_run"] == row["run_id"] or row["due"]:
            out.append(records.Queued(row["into_run"], run.job_id))
        else:
            out.append(records.Gathered(run.job_id, row["into_run"]))
    return out
