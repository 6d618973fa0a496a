"""The way back to plain Celery, as one command (``motir rollback``; docs/operations.md, "Rolling back to plain Celery").

For the direct jobs named (or all of them), while no worker of this release consumes their queues:

1. **purge the run messages** — a job's run message carries the run id as its one argument (and
   as its task id), which a plain task would take as its own argument (``TypeError: add() missing
   1 required positional argument``); a durable Celery task's (``@app.task(durable=True)``) is
   Celery's own message under its run's id, which a plain worker would run beside the work handed
   back in step 2. Every message of the jobs' queues is taken off; a run's message (either shape:
   a job's, or any message of these jobs whose task id is a queued or running run's) is dropped,
   any other message (the team's other tasks, a producer's call in Celery's protocol that no run
   was written for) is put back as it was — its content kept, not its place in the queue;
2. **hand each queued run back**: in one transaction, the run is cancelled (a conditional UPDATE:
   only a run still queued, marked ``claimed_by = 'motir rollback'``) and its work is sent as a
   plain Celery message — the same task name, the same arguments, its countdown kept — under a
   task id of its own, derived from the run id (``uuid5``) and kept on the run. The message is
   sent before that transaction commits: a send that fails rolls the cancel back (the run stays
   queued, the command says so). Rolling forward again cannot run that work twice: the run is
   cancelled for good, and a re-sent message a worker of this release finds still queued is
   adopted as a run of its own (under its own task id), once.
3. **running runs** are left to their workers: a warm shutdown finishes them; one whose worker
   died resumes, from its stored steps, when a worker of this release runs again.

``dry_run`` reports all of it and changes nothing (the queues' lengths, not their contents).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from celery import Celery
from kombu.entity import Queue
from kombu.messaging import Producer

from motir_celery.adapter.messages import argsrepr
from motir_celery.core.engine import Engine
from motir_celery.core.jobs import Job, alias_name, all_jobs, task_name
from motir_celery.store.sql import operator as operator_sql

__all__ = ["Rollback", "roll_back", "RESENT"]

log = logging.getLogger("motir_celery.adapter.rollback")

#: The namespace of the task ids a rolled-back run's work is re-sent under.
RESENT = uuid.UUID("5d6f7469-7200-4c6c-8a4f-726f6c6c6261")


@dataclass
class Rollback:
    """What ``roll_back`` did (or, with ``dry_run``, would do)."""

    jobs: list[str]
    queues: dict[str, int] = field(default_factory=dict)      # queue -> messages in it before
    purged: int = 0                                            # run messages dropped
    kept: int = 0                                              # other messages put back
    resent: list[tuple[str, str, str]] = field(default_factory=list)   # (run id, task name, task id)
    with_steps: list[str] = field(default_factory=list)        # resent runs that had stored steps
    running: list[str] = field(default_factory=list)           # left to their workers
    failed: list[tuple[str, str]] = field(default_factory=list)         # (run id, why): still queued
    dry_run: bool = False


def direct_jobs(names: Iterable[str] | None) -> list[Job]:
    """The direct jobs named (by id or task name), or every one this process knows."""
    jobs = [j for j in all_jobs() if j.direct and not j.id.startswith("system.")]
    if names is None:
        return jobs
    wanted = set(names)
    found = [j for j in jobs if j.id in wanted or j.task_name in wanted]
    missing = wanted - {j.id for j in found} - {j.task_name for j in found}
    if missing:
        raise LookupError(f"no direct job {', '.join(sorted(missing))} (motir jobs lists them)")
    return found


def _queues(app: Celery, jobs: list[Job]) -> list[str]:
    names = {str(app.conf.task_default_queue or "celery")}
    for job in jobs:
        route = app.amqp.router.route({"queue": job.options["queue"]} if "queue" in job.options else {},
                                      task_name(job.id), (), {}, None)
        if route.get("queue") is not None:
            names.add(route["queue"].name)
    return sorted(names)


def _is_run_message(message: Any, names: set[str], runs: set[str]) -> bool:
    """A run's message: one of the jobs' tasks, and its id a pending run's (``runs``: a durable
    Celery task's message is Celery's own, under its run's id), or a job's run message (one
    argument, the run id)."""
    headers = message.headers or {}
    if headers.get("task") not in names:
        return False
    if str(headers.get("id")) in runs:
        return True
    try:
        args, kwargs, _ = message.decode()
    except Exception:  # noqa: BLE001 — not Celery's protocol 2: not one of ours either
        return False
    run = str(args[0]) if isinstance(args, (list, tuple)) and len(args) == 1 else None
    return not kwargs and run is not None and (
        run == headers.get("id") or headers.get("argsrepr") == argsrepr(str(headers.get("task")), run))


def _purge(app: Celery, queue: str, names: set[str], runs: set[str], report: Rollback) -> None:
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        bound = Queue(queue, routing_key=queue)(channel)  # type: ignore[no-untyped-call]
        # The default exchange: routed by the queue's name.
        producer = Producer(channel, routing_key=queue)  # type: ignore[no-untyped-call]
        for _ in range(report.queues.get(queue, 0)):
            message = bound.get(no_ack=False)  # type: ignore[no-untyped-call]
            if message is None:
                break
            if _is_run_message(message, names, runs):
                report.purged += 1
            else:
                props = message.properties
                producer.publish(  # type: ignore[no-untyped-call]
                    message.body, routing_key=queue, headers=message.headers,
                                 content_type=message.content_type, content_encoding=message.content_encoding,
                                 correlation_id=props.get("correlation_id"), reply_to=props.get("reply_to"),
                                 priority=props.get("priority"), delivery_mode=props.get("delivery_mode") or 2)
                report.kept += 1
            message.ack()


def _length(app: Celery, queue: str) -> int:
    with app.connection_for_write() as conn:
        try:
            return int(conn.default_channel.queue_declare(queue=queue, passive=True).message_count)
        except Exception:  # noqa: BLE001 — a queue never declared holds nothing
            return 0


def roll_back(engine: Engine, app: Celery, jobs: list[Job], *, dry_run: bool = False,
              purge: bool = True) -> Rollback:
    """Hand the queued runs of ``jobs`` back to plain Celery (the module docstring)."""
    report = Rollback([j.id for j in jobs], dry_run=dry_run)
    by_id = {j.id: j for j in jobs}
    names = {n for j in jobs for n in (j.task_name, alias_name(j.id))}
    with engine.pool().connect() as conn, conn.begin():
        pending = operator_sql.rollback_pending(conn, list(by_id))
    if purge:
        runs = {str(run["id"]) for run in pending}
        for queue in _queues(app, jobs):
            report.queues[queue] = _length(app, queue)
            if not dry_run:
                _purge(app, queue, names, runs, report)
    for run in pending:
        run_id = str(run["id"])
        if run["state"] == "running":
            report.running.append(run_id)
            continue
        job, call = by_id[run["job_id"]], run["call"] or {}
        task_id = str(uuid.uuid5(RESENT, run_id))
        if int(run["steps"] or 0):
            report.with_steps.append(run_id)
        if dry_run:
            report.resent.append((run_id, job.task_name, task_id))
            continue
        countdown = run["due_in"].total_seconds() if run["due_in"] is not None else 0.0
        try:
            with engine.pool().connect() as conn, conn.begin():
                if not operator_sql.rollback_cancel(conn, run["id"], task_id):
                    continue  # claimed or cancelled meanwhile: not ours to hand back
                # Sent inside the cancel's transaction: a send that fails leaves the run queued.
                app.send_task(job.task_name, args=list(call.get("args") or []), kwargs=dict(call.get("kwargs") or {}),
                              task_id=task_id, countdown=countdown or None, **_job_queue(job))
        except Exception as exc:  # noqa: BLE001 — reported per run; the others go on
            log.error("run %s of %s not handed back: %s", run_id, job.id, exc)
            report.failed.append((run_id, str(exc)))
            continue
        report.resent.append((run_id, job.task_name, task_id))
    return report


def _job_queue(job: Job) -> dict[str, Any]:
    return {"queue": job.options["queue"]} if "queue" in job.options else {}
