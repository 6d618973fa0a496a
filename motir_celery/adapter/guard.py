"""The worker's inbound guard: nothing in a message can end a worker, or bring it back to the queue.

kombu decodes what a worker takes off a queue, and Celery turns it into a task
request, inside the worker's event loop: an exception there (an item that is not
JSON, a ``headers.task`` that is a list) is an ``Unrecoverable error``, and kombu
restores the unacknowledged item at shutdown, so the worker dies on every restart
(celery/celery#4308). Here such an item is moved to ``<queue>.malformed`` (the
newest 1,000: the item's bytes on a Redis list; the message on a durable RabbitMQ
queue, why in its ``x-motir-malformed`` header), logged at ERROR with the reason,
and acknowledged; the worker goes on. Two points see every failure:

- the callback of a consumer that acknowledges (a worker's task consumer; Celery's
  gossip, control and mingle consumers do not), both transports: ``task_problem``
  checks the message first — the body decodes under the consumer's ``accept``
  (memoized by kombu: Celery does not decode it again), a task message has
  Celery's protocol shapes and types (``timelimit`` is read later, by the pool,
  where nothing could catch it) — and whatever Celery's handling still raises is
  caught. A well-formed message goes to Celery untouched: a job's message whose
  argument is not a run id is the job's to log; one Celery refuses as an unknown task
  is set aside after Celery's callback (``SET_ASIDE``, ``unknown.py``), or its run failed
  into the DLQ.
- Redis only, the read (``_brpop_read``): an item kombu cannot make a message of.

Network errors are never an item's: raised as before (kombu reconnects; RabbitMQ
redelivers). Control messages (Redis pub/sub, RabbitMQ fanout) are not guarded:
whoever can write them can send ``shutdown``, and Celery catches its handler's errors.

kombu internals leaned on, each with a test in tests/adapter/test_poison_messages.py that
fails without it (the worker would then die of such an item as before; supervision
restarts it): Redis ``Channel._create_client`` (its asynchronous client's
``parse_response``, wrapped to remember the BRPOP reply), ``Channel._brpop_read``,
``Channel.basic_consume(queue, no_ack, callback, ...)``; kombu's ``Consumer``
registering its bound ``_receive_callback`` (for its ``accept``); py-amqp's
``basic_consume(..., callback=)``, kombu's ``pyamqp`` Connection/Channel classes and
``message_to_python``.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Callable

import amqp  # type: ignore[import-untyped]  # py-amqp ships no types
import redis.exceptions
from celery.utils.time import maybe_iso8601
from kombu.exceptions import ContentDisallowed, InconsistencyError
from kombu.transport import pyamqp as kombu_amqp
from kombu.transport import redis as kombu_redis

__all__ = ["task_problem", "GuardedRedisTransport", "GuardedAMQPTransport", "MALFORMED_SUFFIX",
           "MALFORMED_KEPT", "MALFORMED_HEADER", "SET_ASIDE"]

log = logging.getLogger("motir_celery.adapter.guard")

#: Where the guard moves an item: ``<queue>.malformed``.
MALFORMED_SUFFIX = ".malformed"
#: The newest this many items are kept there.
MALFORMED_KEPT = 1000
#: The header of a message moved aside on RabbitMQ that names why.
MALFORMED_HEADER = "x-motir-malformed"
#: The attribute a handler inside Celery's callback sets on a message it wants moved aside, with why
#: (``unknown.py``: a task no worker here registers); read once the callback has returned.
SET_ASIDE = "motir_set_aside"

# Errors of the broker's connection: never an item's fault (kombu's own
# connection_errors also list KeyError, which an item raises easily).
_NETWORK = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, amqp.exceptions.AMQPError,
            InconsistencyError, OSError)


# --- what Celery reads from a task message ---------------------------------------------

def _str(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _opt_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _opt_int(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def _opt_bool(value: Any) -> bool:
    return value is None or isinstance(value, bool)


def _seconds(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and math.isfinite(value) and value >= 0)


def _timelimit(value: Any) -> bool:  # (hard, soft); the pool reads it after the callback has returned
    return value is None or (isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_seconds, value)))


def _instant(value: Any) -> bool:  # as Celery's Request parses eta and expires ("" parses to None, and fails)
    if value is None:
        return True
    if not isinstance(value, str):
        return False
    try:
        return maybe_iso8601(value) is not None
    except Exception:  # noqa: BLE001 — dateutil raises ValueError, OverflowError, ...
        return False


def _str_list(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _opt_dict(value: Any) -> bool:
    return value is None or isinstance(value, dict)


def _signatures(value: Any) -> bool:  # callbacks, errbacks, chain: signatures as Celery serializes them
    return value is None or (isinstance(value, list) and all(isinstance(v, dict) for v in value))


# The fields of a task (protocol 2 headers; protocol 1 body) and what each must be.
_TASK_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "task": (_str, "a task name"),
    "id": (_str, "a task id (a string)"),
    "shadow": (_opt_str, "a string or null"),
    "root_id": (_opt_str, "a string or null"),
    "parent_id": (_opt_str, "a string or null"),
    "group": (_opt_str, "a string or null"),
    "group_index": (_opt_int, "a count or null"),
    "lang": (_opt_str, "a string or null"),
    "argsrepr": (_opt_str, "a string or null"),
    "kwargsrepr": (_opt_str, "a string or null"),
    "origin": (_opt_str, "a string or null"),
    "eta": (_instant, "an ISO 8601 time or null"),
    "expires": (_instant, "an ISO 8601 time or null"),
    "retries": (_opt_int, "a count or null"),
    "timelimit": (_timelimit, "[hard, soft] in seconds (numbers or null)"),
    "ignore_result": (_opt_bool, "true, false or null"),
    "replaced_task_nesting": (_opt_int, "a count or null"),
    "stamped_headers": (_str_list, "a list of strings or null"),
    "stamps": (_opt_dict, "an object or null"),
}
_REQUIRED = ("task", "id")
_EMBED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "callbacks": (_signatures, "a list of signatures or null"),
    "errbacks": (_signatures, "a list of signatures or null"),
    "chain": (_signatures, "a list of signatures or null"),
    "chord": (_opt_dict, "a signature or null"),
}
_PROPERTIES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "correlation_id": (_opt_str, "a string or null"),
    "reply_to": (_opt_str, "a string or null"),
    "priority": (_opt_int, "a number or null"),
}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fields(where: str, values: dict[str, Any], fields: dict[str, tuple[Callable[[Any], bool], str]]) -> str | None:
    for name, (valid, expected) in fields.items():
        if name in values and not valid(values[name]):
            return f"{where}.{name} is {_shown(values[name])}, not {expected}"
    return None


def _task_fields(where: str, values: dict[str, Any]) -> str | None:
    for name in _REQUIRED:
        if name not in values:
            return f"{where} has no {name!r}"
    return _fields(where, values, _TASK_FIELDS)


def _call(where: str, args: Any, kwargs: Any) -> str | None:
    if not isinstance(args, (list, tuple)):
        return f"{where} args is {_shown(args)}, not a list"
    if not isinstance(kwargs, dict):
        return f"{where} kwargs is {_shown(kwargs)}, not an object"
    return None


def task_problem(message: Any, accept: Any) -> str | None:
    """Why Celery cannot take ``message`` (a kombu ``Message``) as it is, or ``None``.

    For a consumer that acknowledges what it takes: in a worker, Celery's task
    consumer (its gossip, control and mingle consumers do not). ``accept`` is the
    consumer's set of content types; ``None`` (not known): the body is left to the
    consumer, and a message with no ``headers.task`` too."""
    if message.errors:  # kombu could not decompress the body
        return f"its body could not be decompressed: {message.errors[0][1]!r}"
    headers, properties = message.headers, message.properties
    if not isinstance(headers, dict):
        return f"its headers are {_shown(headers)}, not an object"
    if not isinstance(properties, dict):
        return f"its properties are {_shown(properties)}, not an object"
    if (problem := _fields("properties", properties, _PROPERTIES)) is not None:
        return problem
    for name, value in (("content type", message.content_type), ("content encoding", message.content_encoding)):
        if not _opt_str(value):
            return f"its {name} is {_shown(value)}, not a string"
    if not isinstance(message.delivery_info, dict):
        return f"its properties.delivery_info is {_shown(message.delivery_info)}, not an object"
    if accept is None:
        return _task_fields("headers", headers) if "task" in headers else None
    message.accept = accept  # as kombu's Consumer sets it next; decode() memoizes the body for Celery
    try:
        body = message.decode()
    except ContentDisallowed:
        return f"its content type {message.content_type!r} is not accepted here ({', '.join(sorted(accept))})"
    except Exception as exc:  # noqa: BLE001 — DecodeError, and whatever a decoder raises
        return f"its body does not decode as {message.content_type!r}: {exc!r}"
    if "task" in headers:  # protocol 2: Celery's task consumer reads the headers first
        if (problem := _task_fields("headers", headers)) is not None:
            return problem
        if isinstance(body, dict) and "args" in body:  # a hybrid of protocols 1 and 2: the body's fields too
            return (_fields("body", body, _TASK_FIELDS) or _fields("body", body, _EMBED_FIELDS)
                    or _call("the body's", body["args"], body.get("kwargs", {})))
        if not (isinstance(body, (list, tuple)) and len(body) == 3):
            return f"its body is {_shown(body)}, not [args, kwargs, embed]"
        args, kwargs, embed = body
        if (problem := _call("the body's", args, kwargs)) is not None:
            return problem
        if not isinstance(embed, dict):
            return f"the body's embed is {_shown(embed)}, not an object"
        return _fields("embed", embed, _EMBED_FIELDS)
    if isinstance(body, dict) and "task" in body:  # protocol 1: the task's fields are in the body
        return (_task_fields("body", body) or _fields("body", body, _EMBED_FIELDS)
                or _call("the body's", body.get("args", ()), body.get("kwargs", {})))
    return "it names no task (no headers.task, and its body is not a protocol 1 task)"


# --- the consumer's callback: both transports ------------------------------------------

class Refused(Exception):
    """Raised through kombu's read by a consumer callback that refused an item (Redis)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _ack(message: Any) -> None:
    """Acknowledge ``message`` unless Celery did: a later shutdown must not restore it."""
    if message.acknowledged:
        return
    try:
        message.ack()
    except Exception:  # noqa: BLE001 — kombu's ack reads delivery_info, which may be what is wrong
        try:
            message.channel.basic_ack(message.delivery_tag)
        except Exception as exc:  # noqa: BLE001 — the item is aside either way
            log.warning("could not acknowledge a malformed message (delivery tag %r): %r", message.delivery_tag, exc)


def _guarded(callback: Callable[[Any], Any], to_message: Callable[[Any], Any],
             refuse: Callable[[Any, str], None]) -> Callable[[Any], Any]:
    """``callback`` (kombu's ``Consumer._receive_callback``), with the item refused when it
    cannot be a message for it or when handling it raises (not a network error)."""
    consumer = getattr(callback, "__self__", None)

    def deliver(raw: Any) -> Any:
        message = to_message(raw)
        why = task_problem(message, getattr(consumer, "accept", None))
        if why is None:
            try:
                delivered = callback(message)
            except _NETWORK:
                raise
            except Exception as exc:  # noqa: BLE001 — the item's fault: it is what changed
                why = f"Celery failed on it: {exc!r}"
            else:
                why = getattr(message, SET_ASIDE, None)   # Celery took it, and refused it (unknown.py)
                if why is None:
                    return delivered
        refuse(message, why)  # moves it aside and acknowledges it
        return None

    return deliver


# --- Redis --------------------------------------------------------------------------

def _unreadable(item: bytes | str, exc: BaseException) -> str:
    """Why kombu could not make a message of ``item``."""
    try:
        payload = json.loads(item.decode() if isinstance(item, bytes) else item)
    except UnicodeDecodeError:
        return "it is not UTF-8 text"
    except ValueError as err:
        return f"it is not JSON ({err})"
    if not isinstance(payload, dict):
        return f"it is JSON but not an object ({type(payload).__name__})"
    properties, headers = payload.get("properties"), payload.get("headers")
    if not isinstance(properties, dict):
        return f"it is not a kombu envelope: its properties are {_shown(properties)}, not an object"
    if "delivery_tag" not in properties:
        return "it is not a kombu envelope: it has no properties.delivery_tag"
    if headers and not isinstance(headers, dict):
        return f"it is not a kombu envelope: its headers are {_shown(headers)}, not an object"
    return f"it is not a kombu envelope: {exc!r}"


class _GuardedChannel(kombu_redis.Channel):
    """kombu's Redis channel; an item that cannot be read or handled is moved to ``<queue>.malformed``."""

    _last_brpop: Any = None
    _reading = False  # inside _brpop_read: a callback's refusal is raised to it

    def _create_client(self, asynchronous: bool = False) -> Any:
        client = super()._create_client(asynchronous)  # type: ignore[no-untyped-call]  # kombu is untyped
        if asynchronous:  # the client the consumer's BRPOP goes through
            parse = client.parse_response

            def remembering(connection: Any, command_name: str, **options: Any) -> Any:
                reply = parse(connection, command_name, **options)
                if command_name == "BRPOP":
                    self._last_brpop = reply
                return reply

            client.parse_response = remembering
        return client

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        # virtual.Channel.basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        positional = list(args)
        no_ack = kwargs["no_ack"] if "no_ack" in kwargs else bool(positional and positional[0])
        if not no_ack:
            if "callback" in kwargs:
                kwargs["callback"] = _guarded(kwargs["callback"], self.message_to_python, self._refuse)
            elif len(positional) > 1:
                positional[1] = _guarded(positional[1], self.message_to_python, self._refuse)
        return super().basic_consume(queue, *positional, **kwargs)  # type: ignore[no-untyped-call]

    def _refuse(self, message: Any, why: str) -> None:
        _ack(message)  # first: the item itself is kept by _brpop_read, which the raise reaches
        if self._reading:
            raise Refused(why)
        # Not an item off a list (kombu's synchronous basic_get): there is no raw item to keep.
        log.error("a malformed message (delivery tag %r) was dropped: %s", message.delivery_tag, why)

    def _brpop_read(self, **options: Any) -> Any:
        self._last_brpop, self._reading = None, True
        try:
            return super()._brpop_read(**options)  # type: ignore[no-untyped-call]
        except Refused as refused:
            why = refused.why
        except _NETWORK:
            raise
        except Exception as exc:  # noqa: BLE001
            if not self._last_brpop:
                raise  # no item was read: not an item's fault
            why = _unreadable(self._last_brpop[1], exc)
        finally:
            self._reading = False
        if not self._last_brpop:  # refused, but the reply was not remembered: no bytes to keep
            log.error("a malformed message was dropped (its item was not kept): %s", why)
            return True
        key, item = self._last_brpop
        self._move_aside(key, item, why)
        return True

    def _move_aside(self, key: bytes | str, item: bytes | str, why: str) -> None:
        queue = (key.decode() if isinstance(key, bytes) else key).rsplit(self.sep, 1)[0]
        prefix = getattr(self, "global_keyprefix", "") or ""
        if prefix and queue.startswith(prefix):  # the client adds it again
            queue = queue[len(prefix):]
        aside = queue + MALFORMED_SUFFIX
        try:
            with self.conn_or_acquire() as client:  # a pooled connection, not the consumer's
                client.pipeline().lpush(aside, item).ltrim(aside, 0, MALFORMED_KEPT - 1).execute()
            where = f"moved to the Redis list {aside!r}"
        except Exception as exc:  # noqa: BLE001 — dropping it is still better than dying of it
            where = f"dropped (moving it to {aside!r} failed: {exc})"
        log.error("a malformed message on queue %r was %s: %s; the item: %r", queue, where, why, item[:200])


class GuardedRedisTransport(kombu_redis.Transport):
    """``broker_transport`` for a ``redis://`` broker: kombu's, with ``_GuardedChannel``."""

    Channel = _GuardedChannel


# --- RabbitMQ (py-amqp) -----------------------------------------------------------------

class _GuardedAMQPChannel(kombu_amqp.Channel):
    """kombu's AMQP channel; a message a consumer cannot take is moved to ``<queue>.malformed``."""

    def message_to_python(self, raw_message: Any) -> Any:
        if isinstance(raw_message, kombu_amqp.Message):  # already made by the guard
            return raw_message
        return super().message_to_python(raw_message)  # type: ignore[no-untyped-call]

    def basic_consume(self, queue: str = "", consumer_tag: str = "", no_local: bool = False,
                      no_ack: bool = False, exclusive: bool = False, nowait: bool = False,
                      callback: Callable[[Any], Any] | None = None, arguments: Any = None,
                      on_cancel: Any = None, argsig: str = "BssbbbbF") -> Any:
        if callback is not None and not no_ack:
            self._declare_aside(queue, nowait=False)  # here, not in a delivery: a mismatch fails the consumer's start

            def refuse(message: Any, why: str) -> None:
                self._move_aside(queue, message, why)
                _ack(message)  # after: a channel lost while moving it leaves it to be redelivered

            callback = _guarded(callback, self.message_to_python, refuse)
        return super().basic_consume(queue, consumer_tag, no_local, no_ack, exclusive, nowait,
                                     callback, arguments, on_cancel, argsig)

    def _declare_aside(self, queue: str, nowait: bool) -> None:
        self.queue_declare(queue + MALFORMED_SUFFIX, durable=True, auto_delete=False, nowait=nowait,
                           arguments={"x-max-length": MALFORMED_KEPT})

    def _move_aside(self, queue: str, message: Any, why: str) -> None:
        aside = queue + MALFORMED_SUFFIX
        try:
            # Again (an operator may have deleted it), and nowait: no reply is awaited inside a
            # delivery (waiting would dispatch the next delivery in here).
            self._declare_aside(queue, nowait=True)
            properties = dict(message.properties)
            properties["application_headers"] = {**(properties.get("application_headers") or {}),
                                                 MALFORMED_HEADER: why}
            self.basic_publish(amqp.Message(message.body, **properties), exchange="", routing_key=aside)
            where = f"moved to the RabbitMQ queue {aside!r}"
        except _NETWORK:
            raise  # the channel is gone: unacknowledged, the broker redelivers it
        except Exception as exc:  # noqa: BLE001 — dropping it is still better than dying of it
            where = f"dropped (moving it to {aside!r} failed: {exc!r})"
        log.error("a malformed message on queue %r was %s: %s; the body: %r", queue, where, why,
                  (message.body or b"")[:200])


class _GuardedAMQPConnection(kombu_amqp.Connection):
    Channel = _GuardedAMQPChannel


class GuardedAMQPTransport(kombu_amqp.Transport):
    """``broker_transport`` for an ``amqp://`` broker: kombu's py-amqp, with ``_GuardedAMQPChannel``."""

    Connection = _GuardedAMQPConnection


#: The import paths for ``app.conf.broker_transport``.
GUARDED_REDIS_TRANSPORT = f"{__name__}:GuardedRedisTransport"
GUARDED_AMQP_TRANSPORT = f"{__name__}:GuardedAMQPTransport"
