"""A run's message: the engine's host on a Celery app (``CeleryHost``), and its short way onto Redis.

A run's message is a Celery task message (protocol 2) for the job's task
(``Job.task_name``: its Celery name, else ``motir.<job_id>``) with one argument, the
run id, which is also the message's Celery task id: every message of one run (its
retries, a re-publish) has the run's id, so Flower shows one task per run and
``AsyncResult(<that id>)`` is the run's (the result backend of ``backend.py``).
``app.send_task`` builds and sends it; on Redis it also, on every call, merges the task's options, asks the router, fires the
publish signals, acquires a pooled producer, builds a fresh ``redis.Redis``
client inside kombu and wraps the write in kombu's retry machinery. At one
event every 20 ms that is ~1.3 ms between the commit and the message being in
Redis, a fifth of enqueue->completion (docs/performance.md).

So on a plain Redis broker the message is built by Celery (``create_task_message``,
the same headers ``send_task`` writes) and pushed by this module: kombu's Redis
envelope, then one LPUSH on a client held per app and process (0.4-0.6 ms with
its reply). A job's message is built once, with stand-ins for its ids, and
each run's is rendered from it (``Plan``); one with an eta, or sent from
within a task (Celery then names the task as parent), is built afresh. The
envelope is kombu's wire format, which publishers and workers of different
kombu versions already share; a test decodes what we push next to what
``send_task`` pushes. The short way is taken only where it writes what
``send_task`` would (``Tuning.direct_publish``: on); otherwise, and
whenever the push fails, ``send_task`` does the work (with Celery's publish
retries):

- the broker URL is one ``redis://`` URL, with no SSL settings and no transport
  option that changes keys or priorities (``global_keyprefix``, ``priority_steps``);
- the route is a queue on a direct exchange, without ``x-expires``
  (``send_task`` publishes that to the default exchange: the queue's own list);
- nothing listens to ``before_task_publish`` / ``after_task_publish`` (tracing
  and error-reporting libraries add headers there) and ``task_send_sent_event``
  is off;
- the queue has had its first message in this process through ``send_task``,
  which declares it (kombu's bindings, for anyone who routes by exchange).

A held kombu producer and ``send_task(producer=...)`` keep every per-call cost above
except the pool acquire (measured 1.36 ms against 1.44), so they are not used.

A batch (``send_events``) pushes its messages in one pipelined round trip
(``CeleryHost.publish_many``). A call with its own ``queue=`` / ``priority=`` goes through
``send_task`` with that queue and the priority spelled for the broker (``routed``); the
run's row holds the priority too, the queue is that message's only: a message the
sweeper re-publishes follows the job's route.

The reading side's guard (``GuardedRedisTransport``, moving an item a worker
cannot take to ``<queue>.malformed``) lives in ``guard.py``; it is importable from
here too, by the path docs/operations.md gives for an attached app.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import threading
import uuid
import weakref
from dataclasses import dataclass, replace
from typing import Any, Sequence

from celery import Celery, signals

from motir_celery.adapter.guard import GUARDED_REDIS_TRANSPORT, MALFORMED_SUFFIX, GuardedRedisTransport
from motir_celery.core.current import current
from motir_celery.core.engine import Engine
from motir_celery.core.jobs import TASK_OPTIONS, alias_name, find_job, task_name
from motir_celery.core.publish import Publish
from motir_celery.core.worker.inline import Inline
from motir_celery.forks import per_process

__all__ = ["CeleryHost", "host", "hosted", "hosts", "engine_of", "RedisLane", "GuardedRedisTransport", "MALFORMED_SUFFIX", "GUARDED_TRANSPORT",
           "task_options", "argsrepr", "redis_lane", "routed_options", "publish_name"]

log = logging.getLogger("motir_celery.adapter.messages")


class CeleryHost:
    """The engine's host on a Celery app: one message per run, by task name (the module docstring).

    An app in Celery's eager mode (``task_always_eager``, read at each message) runs each run
    in this process, at once, through the engine (``Inline``, one per thread: a run published
    while one of the thread's runs executes waits for it, as the next message would)."""

    def __init__(self, app: Celery, engine: Engine) -> None:
        self.app = app
        self.engine = engine
        self._inline = threading.local()
        #: The task names registered on the app for the engine's jobs (``celery_app.attach``).
        self.task_names: set[str] = set()
        #: ``MOTIR_IMPORTS`` imported for the app (``celery_app.import_jobs``).
        self.jobs_imported = False

    def __repr__(self) -> str:
        return f"<CeleryHost {self.app.main}>"

    def app_setting(self, key: str, default: object = None) -> object:
        """The app's configuration key ``key`` (the engine's own jobs read theirs: core/system_jobs.py)."""
        return self.app.conf.get(key, default)

    @property
    def eager(self) -> bool:
        return bool(self.app.conf.task_always_eager)

    def _here(self) -> Inline:
        inline: Inline | None = getattr(self._inline, "runner", None)
        if inline is None:
            inline = self._inline.runner = Inline(self.engine)
        return inline

    def publish(self, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
        if self.eager:
            self._here().publish(run_id, job_id, countdown)
            return
        app, alias = self.app, self.engine.settings.publish_alias
        lane = redis_lane(app, self.engine.tuning.direct_publish)
        if lane is not None and lane.push(run_id, job_id, countdown, alias):
            return
        options = routed_options(app, job_id, alias)
        priority = _message_priority(app, job_id)
        if priority is not None:
            options["priority"] = priority
        app.send_task(publish_name(job_id, alias), args=[str(run_id)], countdown=countdown or None,
                      task_id=str(run_id), argsrepr=argsrepr(job_id, run_id), **options)

    def publish_many(self, runs: Sequence[tuple[uuid.UUID, str]]) -> None:
        """Every run of a batch, due now: pipelined onto Redis where the lane takes them (one round
        trip); the rest one by one. If the pipeline fails, every message of it goes one by one — a
        message that did reach Redis is then sent twice, which the claim makes harmless."""
        app, alias = self.app, self.engine.settings.publish_alias
        lane = None if self.eager else redis_lane(app, self.engine.tuning.direct_publish)
        eligible = (lane is not None and not lane.sent_events and not signals.before_task_publish.receivers
                    and not signals.after_task_publish.receivers
                    and not (app.current_task is not None and app.current_worker_task is not None))
        rest: list[tuple[uuid.UUID, str]] = []
        piped: list[tuple[uuid.UUID, str]] = []
        if eligible and lane is not None:
            pipe = lane.client.pipeline(transaction=False)
            for run_id, job_id in runs:
                plan = lane.plan_of(job_id, alias)
                if plan is None:
                    rest.append((run_id, job_id))  # send_task (and, the first time, its queue declaration)
                    continue
                pipe.lpush(plan.key, plan.render(run_id, app.thread_oid))
                piped.append((run_id, job_id))
            if piped:
                try:
                    pipe.execute()
                except Exception as exc:  # noqa: BLE001 — send_task, with its retries, decides
                    log.warning("pipelining %d run messages to Redis failed (%s); publishing through send_task",
                                len(piped), exc)
                    rest = piped + rest
        else:
            rest = list(runs)
        for run_id, job_id in rest:
            self.publish(run_id, job_id, 0.0)

    def routed(self, queue: str | None, priority: int | None) -> Publish:
        """One call's message with its own ``queue=`` / ``priority=``, through ``send_task``."""
        if (queue is None and priority is None) or self.eager:
            return self.publish
        app, alias = self.app, self.engine.settings.publish_alias

        def publish(run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
            options = routed_options(app, job_id, alias)
            if queue is not None:
                options["queue"] = queue
            if priority:
                scheme = str(app.conf.broker_url or "").split("://", 1)[0]
                options["priority"] = 9 - priority if scheme.startswith(("redis", "rediss")) else priority
            app.send_task(publish_name(job_id, alias), args=[str(run_id)], countdown=countdown or None,
                          task_id=str(run_id), argsrepr=argsrepr(job_id, run_id), **options)

        return publish


#: The attribute of a Celery app that holds its ``CeleryHost`` (``attach`` sets it).
HOST_ATTRIBUTE = "motir_host"


def host(app: Celery, engine: Engine) -> CeleryHost:
    """``app`` hosts ``engine`` from now on: the engine the adapter's parts serving the app use
    (a task's run, the worker's side duties, the result backend, the beat). The app keeps the
    ``CeleryHost`` (and its bookkeeping: the task names registered, the job modules imported)
    whatever the engine publishes through later."""
    found = hosted(app)
    if found is None or found.engine is not engine:
        found = CeleryHost(app, engine)
        setattr(app, HOST_ATTRIBUTE, found)
    return found


def hosted(app: Any) -> CeleryHost | None:
    """The ``CeleryHost`` of an attached app, or None."""
    found = getattr(app, HOST_ATTRIBUTE, None)
    return found if isinstance(found, CeleryHost) else None


def hosts(app: Any) -> Engine | None:
    """The engine ``app`` was attached to, or None."""
    found = hosted(app)
    return found.engine if found is not None else None


def engine_of(app: Any) -> Engine:
    """The engine ``app`` hosts; the current one for an app that never attached (as a Celery app
    without our tasks has no other)."""
    found = hosts(app)
    return found if found is not None else current()


def publish_name(job_id: str, alias: bool) -> str:
    """The name the engine's messages for ``job_id`` carry: its task name, or with ``alias``
    (``MOTIR_PUBLISH_ALIAS=1``) ``motir.<job_id>`` — a rolling cut-over: workers of the code before
    it have a plain Celery task under the Celery name, and would run it with a run id for its argument."""
    return alias_name(job_id) if alias else task_name(job_id)


def task_options(job_id: str) -> dict[str, Any]:
    """The job's Celery options (define_job's ``queue=``, ``time_limit=``, ``soft_time_limit=``),
    given to every message: ``send_task`` reads a task's own options only from an app
    already finalized (a worker's), so a web process would send to the default queue."""
    job = find_job(job_id)
    if job is None:
        return {}
    return {k: job.options[k] for k in TASK_OPTIONS if k in job.options}


def routed_options(app: Celery, job_id: str, alias: bool) -> dict[str, Any]:
    """``task_options``, and under ``MOTIR_PUBLISH_ALIAS`` the queue the job's Celery name is
    routed to (``task_routes`` name it, not the alias the message carries)."""
    options = task_options(job_id)
    name = task_name(job_id)
    if "queue" not in options and publish_name(job_id, alias) != name:
        queue = app.amqp.router.route({}, name, (), {}, None).get("queue")
        if queue is not None:
            options["queue"] = queue.name
    return options


def argsrepr(job_id: str, run_id: uuid.UUID | str) -> str:
    return f"{job_id} run={run_id}"  # what Flower shows for the task's arguments


def _message_priority(app: Celery, job_id: str) -> int | None:
    """A job's priority (0-9, higher is more urgent) as the broker spells it.

    RabbitMQ: higher is more urgent, but only on a queue declared with
    ``x-max-priority`` (Celery's ``task_queue_max_priority``). Redis: kombu
    sorts 0 first, so the scale is inverted. Priority 0 sends no priority at all.
    """
    job = find_job(job_id)
    if job is None or not job.run_options.priority:
        return None
    scheme = str(app.conf.broker_url or "").split("://", 1)[0]
    return 9 - job.run_options.priority if scheme.startswith(("redis", "rediss")) else job.run_options.priority


# Transport options that leave the key and the envelope of a message as they are.
_HARMLESS_OPTIONS = frozenset({
    "ack_emulation", "visibility_timeout", "polling_interval", "queue_order_strategy", "fanout_prefix",
    "fanout_patterns", "unacked_key", "unacked_index_key", "unacked_mutex_key", "unacked_mutex_expire",
    "unacked_restore_limit", "socket_timeout", "socket_connect_timeout", "socket_keepalive",
    "socket_keepalive_options", "health_check_interval", "retry_on_timeout", "max_connections", "client_name",
})
_PRIORITY_STEPS = (0, 3, 6, 9)  # kombu's Redis default: a priority is pushed to the list of the step below it
_PRIORITY_SEP = "\x06\x16"     # kombu's Redis separator between a queue's name and its priority step

class _Lanes:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_app: "weakref.WeakKeyDictionary[Celery, RedisLane | None]" = weakref.WeakKeyDictionary()


_lanes = per_process(_Lanes)  # a forked child opens its own sockets


def redis_lane(app: Celery, direct: bool = True) -> "RedisLane | None":
    """This process's short way for ``app``; ``None`` where the broker rules it out (or not ``direct``)."""
    if not direct:
        return None
    lanes = _lanes()
    with lanes.lock:
        if app not in lanes.by_app:
            lanes.by_app[app] = RedisLane.for_app(app)
        return lanes.by_app[app]


# Stand-ins for what differs between two messages of a job (Plan.render).
_TASK_ID, _RUN_ID, _REPLY_TO, _TAG, _BODY = (f"<motir-{part}-3f9c1e>" for part in ("task", "run", "reply", "tag", "body"))


@dataclass(frozen=True)
class Plan:
    """What every message of one job has in common on this lane: where it goes,
    and the message itself with stand-ins for its ids (built once by Celery)."""

    job_id: str
    name: str
    queue: str
    key: str
    priority: int | None
    options: dict[str, Any]
    envelope: str
    body: str

    def render(self, run_id: uuid.UUID, reply_to: str) -> str:
        """The message of ``run_id``, due now, sent from outside any task.

        Not ``create_task_message`` and two ``json.dumps`` per message, as ``built`` does: at low
        load that Python alone is ~0.2 ms between commit and LPUSH."""
        run = str(run_id)
        body = base64.b64encode(self.body.replace(_RUN_ID, run).encode()).decode()
        return (self.envelope.replace(_TASK_ID, run).replace(_RUN_ID, run)
                .replace(_REPLY_TO, reply_to).replace(_TAG, _unique_id()).replace(_BODY, body))


def _unique_id() -> str:
    """A random version-4 UUID, as Celery's task ids and kombu's delivery tags are,
    from ``random`` (reseeded in every forked child) rather than a system call:
    unique, not secret."""
    return str(uuid.UUID(int=random.getrandbits(128), version=4))


class RedisLane:
    """Pushes run messages onto kombu's Redis lists with a held client."""

    def __init__(self, app: Celery, url: str, options: dict[str, Any]) -> None:
        import redis

        self.app = app
        self.client = redis.Redis.from_url(url, **options)
        self.origin = f"gen{os.getpid()}@{os.uname().nodename}"
        self.declared: set[str] = set()  # queues send_task has published to (and declared) here
        self.plans: dict[tuple[str, bool], Plan | None] = {}  # per job and name; None: never this way
        self.sent_events = bool(app.conf.task_send_sent_event)  # read once: conf lookups cost ~0.1 ms cold

    @classmethod
    def for_app(cls, app: Celery) -> "RedisLane | None":
        conf = app.conf
        url = str(conf.broker_write_url or conf.broker_url or "")
        options = dict(conf.broker_transport_options or {})
        if (not url.startswith("redis://") or ";" in url or conf.broker_use_ssl or conf.task_protocol != 2
                or conf.task_serializer != "json" or conf.task_compression
                or set(options) - _HARMLESS_OPTIONS):
            return None
        client_options = {k: options[k] for k in ("socket_timeout", "socket_connect_timeout") if k in options}
        return cls(app, url, client_options)

    def push(self, run_id: uuid.UUID, job_id: str, countdown: float, alias: bool = False) -> bool:
        """Push the run's message; ``False``: ``send_task`` must send it (not eligible, or the push failed)."""
        app = self.app
        if signals.before_task_publish.receivers or signals.after_task_publish.receivers or self.sent_events:
            return False
        plan = self.plan_of(job_id, alias)
        if plan is None:
            return False
        try:
            # (current_task first: a plain stack lookup, where current_worker_task costs ~50 us cold.)
            if countdown or (app.current_task is not None and app.current_worker_task is not None):
                message = self.built(plan, run_id, countdown)
            else:
                message = plan.render(run_id, app.thread_oid)
            self.client.lpush(plan.key, message)
        except Exception as exc:  # noqa: BLE001 — any failure: send_task, with its retries, decides
            log.warning("pushing run %s to Redis failed (%s); publishing through send_task", run_id, exc)
            return False
        return True

    def plan_of(self, job_id: str, alias: bool = False) -> Plan | None:
        """The job's plan (``None``: its messages go through send_task); made on its first message."""
        key = (job_id, alias)
        return self.plans[key] if key in self.plans else self._plan(job_id, alias)

    def _plan(self, job_id: str, alias: bool) -> Plan | None:
        """The job's plan, kept once its queue has been declared; ``None`` (kept): send_task always."""
        app, name, options = self.app, publish_name(job_id, alias), task_options(job_id)
        # As send_task routes: the job's own queue if it has one, else task_routes (for the job's
        # Celery name, also when the message carries the alias), else the default.
        route = app.amqp.router.route({"queue": options["queue"]} if "queue" in options else {}, task_name(job_id),
                                      (), {}, None)
        queue = route.get("queue")
        if queue is None or queue.exchange.type != "direct" or queue.expires is not None or set(route) - {"queue"}:
            self.plans[(job_id, alias)] = None
            return None
        if queue.name not in self.declared:
            self.declared.add(queue.name)
            return None  # send_task declares it; the job's next message comes this way
        priority = _message_priority(app, job_id)
        stand_in = Plan(job_id, name, queue.name, _key(queue.name, priority), priority, options, "", "")
        message = self._message(stand_in, _RUN_ID, task_id=_TASK_ID, reply_to=_REPLY_TO, tag=_TAG)
        body = base64.b64decode(message["body"]).decode()
        envelope = json.dumps({**message, "body": _BODY})
        plan = self.plans[(job_id, alias)] = replace(stand_in, envelope=envelope, body=body)
        return plan

    def built(self, plan: Plan, run_id: uuid.UUID, countdown: float) -> str:
        """The message of ``run_id`` built afresh: with an eta, or sent from within a task."""
        parent = self.app.current_worker_task  # as send_task: a message sent from a task names it as parent
        root_id = parent_id = None
        if parent is not None:
            root_id, parent_id = parent.request.root_id or parent.request.id, parent.request.id
        return json.dumps(self._message(plan, str(run_id), task_id=str(run_id), reply_to=self.app.thread_oid,
                                        tag=str(uuid.uuid4()), countdown=countdown, root_id=root_id,
                                        parent_id=parent_id))

    def _message(self, plan: Plan, run: str, *, task_id: str, reply_to: str, tag: str, countdown: float = 0.0,
                 root_id: str | None = None, parent_id: str | None = None) -> dict[str, Any]:
        """Celery's task message for ``run`` in kombu's Redis envelope, as send_task would push it."""
        message = self.app.amqp.create_task_message(
            task_id, plan.name, [run], {}, countdown=countdown or None, reply_to=reply_to, root_id=root_id,
            parent_id=parent_id, origin=self.origin, argsrepr=argsrepr(plan.job_id, run),
            time_limit=plan.options.get("time_limit"), soft_time_limit=plan.options.get("soft_time_limit"),
            ignore_result=None,  # as send_task: the task's own setting decides
        )
        body = json.dumps(message.body, separators=(", ", ": ")).encode()
        return {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": message.headers,
            "properties": {
                **message.properties,
                "argsrepr": message.headers["argsrepr"],  # send_task copies it here too (its options become properties)
                "delivery_mode": 2,  # persistent, as send_task's default
                "delivery_info": {"exchange": "", "routing_key": plan.queue},
                "priority": plan.priority or 0,
                "body_encoding": "base64",
                "delivery_tag": tag,
            },
        }


def _key(queue: str, priority: int | None) -> str:
    """The Redis list of ``queue`` that kombu's consumer reads ``priority`` (0-9, 0 first) from."""
    step = max(s for s in _PRIORITY_STEPS if s <= min(max(priority or 0, 0), 9))
    return f"{queue}{_PRIORITY_SEP}{step}" if step else queue


#: The import path for ``app.conf.broker_transport`` on ``redis://`` (guard.py).
GUARDED_TRANSPORT = GUARDED_REDIS_TRANSPORT
