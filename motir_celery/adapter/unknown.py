"""A message naming a task this worker does not register goes where an operator sees it, never only a log line.

Celery rejects such a message: it logs an ERROR, marks the task failed in the result backend and
sends ``task_unknown`` (``Consumer.on_unknown_task``), inside the consumer's callback. Here, on
that signal:

* **A run's message for a job this worker does not define** — named ``motir.<job id>`` (what the
  engine publishes a run of a job it does not define under: the sweeper re-publishing a run of a
  removed job, a forged run), its task id the run's id — is that run's attempt: the runner claims it
  and, the job unknown, fails it into the DLQ with ``UnknownJobError`` (the path of a run whose job
  is gone from a known task name). A run of a removed job is in the DLQ at its first message, or at
  the sweeper's first re-publish, instead of being re-sent every period for ever.
* **Any other message** (a plain task no worker here registers, a run no longer claimable) is moved
  to ``<queue>.malformed`` with the reason, as the guard moves a message Celery cannot take
  (``guard.py``: the flag ``SET_ASIDE`` on the message, read after Celery's callback returns).

Rolling deploys: a worker rolled after the producers that send a new job would fail that job's runs
here (replayable from the DLQ); roll the workers first, as with Celery, which drops the message.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from celery import signals

from motir_celery.adapter.guard import SET_ASIDE
from motir_celery.adapter.messages import engine_of
from motir_celery.core.jobs import ALIAS_PREFIX

__all__ = ["install"]

log = logging.getLogger("motir_celery.adapter.unknown")


def _run_of(name: Any, task_id: Any) -> tuple[uuid.UUID, str] | None:
    """(run id, job id) when the message is a run's under a job's alias; None otherwise."""
    if not isinstance(name, str) or not name.startswith(ALIAS_PREFIX) or not isinstance(task_id, str):
        return None
    try:
        return uuid.UUID(task_id), name[len(ALIAS_PREFIX):]
    except ValueError:
        return None


def _on_unknown(sender: Any = None, message: Any = None, name: Any = None, id: Any = None,  # noqa: A002
                **_: Any) -> None:
    why = f"no task {str(name)[:200]!r} is registered in this worker"
    run = _run_of(name, id)
    if run is not None and sender is not None:
        run_id, job_id = run
        try:
            outcome = engine_of(sender.app).execute(run_id, job_id=job_id, worker=str(sender.hostname))
        except Exception as exc:  # noqa: BLE001 — the database away: the message is set aside, the run re-sent
            log.warning("run %s of unknown job %s: could not fail it into the DLQ: %r", run_id, job_id, exc)
        else:
            if outcome.state == "failed":
                return  # the DLQ entry is what an operator sees (the runner logged it)
            why += f"; it names run {run_id}, which is not claimable ({outcome.detail or outcome.state})"
    if message is not None:
        setattr(message, SET_ASIDE, why)


def install() -> None:
    """Connect the handler (once per process, whichever app attaches first)."""
    signals.task_unknown.connect(_on_unknown, weak=False, dispatch_uid="motir_celery.adapter.unknown")
