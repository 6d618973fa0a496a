"""What a job's task received: a run's message (the engine's), or a call in Celery's own protocol.

Every message to a job's task goes through ``run_to_execute`` before anything runs:

* **A run's message** names the run (one argument, its id): the engine's messages of
  this release carry the run id as their Celery task id too, those of earlier releases
  say ``"<job_id> run=<run_id>"`` in ``argsrepr``. It is executed as it is (the claim
  decides whether it may run).
* **Anything else, for a direct job, is a call** in Celery's own protocol (2, or 1 as
  Celery still converts it): an old producer's ``.delay()``, ``send_task``, ``celery
  call``, a ``beat_schedule`` entry, a message queued before the cut-over. It is
  *adopted*: stored as the run ``.delay()`` would have written, keyed on its Celery task
  id (``direct.adopt``; a redelivered or duplicated copy finds the same run), committed,
  and then executed here like any run — claim, steps, retries, DLQ. Arguments that
  cannot be stored become a DLQ entry with the reason, and an ERROR line.
* **A call that carries a canvas** (Celery's ``chain``, ``link=`` / ``link_error=`` on the
  message) is adopted whole, as one canvas run (core/producer/canvas.py ``adopt_canvas``): the
  links after it are never dropped. A member of Celery's own chord, or a canvas naming a plain
  task, is refused into the DLQ with the reason.
* **An event or cron job** was never a Celery task: a message for it names a run or is
  malformed, which the runner logs and drops as before.

A Celery task called directly (``app.tasks[name](1, 2)``: no message) runs the body
inline, as calling the job object does (``Job.__call__``).
"""

from __future__ import annotations

import logging
import reprlib
from typing import Any

from motir_celery.adapter.messages import argsrepr
from motir_celery.core.engine import Engine
from motir_celery.core.jobs import Job
from motir_celery.core.producer.canvas import embedded
from motir_celery.core.producer.direct import MAX_SHOWN

__all__ = ["is_run_message", "run_to_execute"]

log = logging.getLogger("motir_celery.adapter.protocol")

_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = 200
_shown.maxlevel = 4


def is_run_message(request: Any, job_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a message names a run (the engine's) rather than calling the job (Celery's protocol)."""
    if kwargs or len(args) != 1 or not isinstance(args[0], str):
        return False
    return args[0] == getattr(request, "id", None) or getattr(request, "argsrepr", None) == argsrepr(job_id, args[0])


def run_to_execute(engine: Engine, request: Any, job: Job, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The run a message stands for, adopted first if it is a call; None: nothing to execute."""
    if not job.direct:
        if not args:
            log.warning("dropping a message with no run id for job %s (task %s, id %s)",
                        job.id, getattr(request, "task", "?"), getattr(request, "id", "?"))
            return None
        return args[0]  # type: ignore[no-any-return]  # the runner checks it is a run id
    if is_run_message(request, job.id, args, kwargs):
        return args[0]  # type: ignore[no-any-return]
    task_id, name = str(getattr(request, "id", "") or ""), str(getattr(request, "task", "") or job.task_name)
    shown = {"argsrepr": str(getattr(request, "argsrepr", None) or _shown.repr(args))[:MAX_SHOWN],
             "kwargsrepr": str(getattr(request, "kwargsrepr", None) or _shown.repr(kwargs))[:MAX_SHOWN]}
    parts = embedded(request)
    if parts:  # Celery's chain / link= / link_error= / chord on the message: the canvas is adopted whole
        _adopt_canvas(engine, job, args, kwargs, task_id, parts, name, shown)
        # Celery's tracer would send the chain's next link and the callbacks itself once this task
        # returns (with its return value as their argument), call the errbacks on a failure, and
        # count a chord member in its result backend: the canvas run does all of that, once.
        for name_ in parts:
            setattr(request, name_, None)
        return None  # published as a canvas run: nothing to execute under this message
    adopted = engine.adopt(job, args, kwargs, task_id, task_name=name, shown=shown)
    if adopted.reason is not None:
        where = (f"kept as DLQ entry {adopted.dlq_id} (motir dlq list; AsyncResult({task_id!r}) is FAILURE)"
                 if adopted.dlq_id is not None else "refused before (its DLQ entry is there already)")
        log.error("a message in Celery's protocol for job %s (task %s, id %.100s) cannot be adopted: %s; %s",
                  job.id, name, task_id, adopted.reason[:500], where)
        return None
    if adopted.run_id is None:
        log.warning("message %.100s of job %s: its task id was used already, by a run this login cannot see",
                    task_id, job.id)
        return None
    log.info("adopted message %.100s of task %s as run %s%s", task_id, name, adopted.run_id,
             " (a copy: the run exists already)" if adopted.deduplicated else "")
    return str(adopted.run_id)


def _adopt_canvas(engine: Engine, job: Job, args: tuple[Any, ...], kwargs: dict[str, Any], task_id: str,
                  parts: dict[str, Any], name: str, shown: dict[str, str]) -> None:
    """A call that carries the rest of a Celery canvas: stored and published as one canvas run
    (core/producer/canvas.py ``adopt_canvas``), whose first link is a member run of its own —
    nothing to execute under this message."""
    adopted = engine.adopt_canvas(job, args, kwargs, task_id, parts, task_name=name, shown=shown)
    if adopted.reason is not None:
        log.error("a message in Celery's protocol for job %s (task %s, id %.100s) carries a canvas (%s) that cannot "
                  "be made durable: %s; kept as DLQ entry %s", job.id, name, task_id, ", ".join(sorted(parts)),
                  adopted.reason[:500], adopted.dlq_id)
        return
    log.info("adopted message %.100s of task %s with the canvas it carries (%s) as canvas run %s%s", task_id, name,
             ", ".join(sorted(parts)), adopted.run_id, " (a copy: the canvas exists already)" if adopted.deduplicated
             else "")
