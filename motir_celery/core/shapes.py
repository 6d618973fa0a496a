"""What the worker and producer rooms both read: a direct run's arguments, and a canvas's node;
and the bound of a ``step.audit`` value, which a worker's step and a direct call's both check.

A direct run's event is named ``direct.<job_id>`` and its data is ``{"args": [...], "kwargs":
{...}}`` (``core/producer/direct.py`` writes it, the runner decodes it). A canvas is one run of
the job ``system.canvas`` whose argument is the canvas as JSON — its *node*
(``core/producer/canvas.py`` builds it, ``core/worker/canvas.py`` walks it).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from motir_celery.errors import AuditValueError, NonRetriableError

__all__ = ["SUBJECT_TYPE", "MAX_SUBJECT_ID", "check_subject", "parse_subject", "DIRECT_PREFIX", "CHILD_EVENT_PREFIX", "event_name", "arguments", "CANVAS_JOB_ID", "KINDS", "MAX_DEPTH", "MEMBER_OPTIONS",
           "CanvasError", "member_id", "is_leaf", "check_node"]

DIRECT_PREFIX = "direct."
#: A child run's event (``step.invoke``, a canvas member) is named ``motir.invoke:<job_id>``.
CHILD_EVENT_PREFIX = "motir.invoke:"


def event_name(job_id: str) -> str:
    """The name of a direct run's event."""
    return f"{DIRECT_PREFIX}{job_id}"


def arguments(data: Any) -> tuple[list[Any], dict[str, Any]]:
    """A direct run's ``(args, kwargs)`` from its event data."""
    if not isinstance(data, dict):
        return [], {}
    return list(data.get("args") or ()), dict(data.get("kwargs") or {})


# --- a run's subject (seed 003) --------------------------------------------------------------

#: A subject's type: a short discriminator the application defines (``media_item``); no ``:``, so
#: ``TYPE:ID`` splits once. Migration 0020's ``subject`` guard holds the app role to the same.
SUBJECT_TYPE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: A subject's id: text (not assumed a UUID), 1 to this many characters.
MAX_SUBJECT_ID = 255


def check_subject(subject: Any) -> tuple[str, str]:
    """``subject=(type, id)`` checked: what a run is about (a direct run's ``{"subject": {...}}``)."""
    if isinstance(subject, (str, bytes)) or not isinstance(subject, (tuple, list)) or len(subject) != 2:
        raise ValueError(f"a subject is a (type, id) pair, got {subject!r:.80}")
    kind, ident = subject
    if not isinstance(kind, str) or not SUBJECT_TYPE.fullmatch(kind):
        raise ValueError(f"a subject's type is 1 to 64 of A-Z a-z 0-9 _ . -, got {kind!r:.80}")
    if not isinstance(ident, str) or not 0 < len(ident) <= MAX_SUBJECT_ID or not ident.isprintable():
        raise ValueError(f"a subject's id is printable text of 1 to {MAX_SUBJECT_ID} characters, got {ident!r:.80}")
    return kind, ident


def parse_subject(text: str) -> tuple[str, str]:
    """``TYPE:ID`` (the command line's ``--subject``) as a checked ``(type, id)``."""
    kind, sep, ident = text.partition(":")
    if not sep:
        raise ValueError(f"a subject is TYPE:ID, got {text!r:.80}")
    return check_subject((kind, ident))


# --- a canvas's node ----------------------------------------------------------------------

#: The job every canvas is a run of (its task: ``motir.system.canvas``).
#: The longest ``step.audit`` value, in characters (the columns are ``varchar(200)``: migration 0020).
AUDIT_MAX = 200


def check_audit(column: str, value: object) -> None:
    """``AuditValueError`` unless ``value`` is 1 to ``AUDIT_MAX`` printable characters (``step.audit``)."""
    if not isinstance(value, str):
        raise AuditValueError(f"step.audit: {column} is a string, not {type(value).__name__}")
    if not value or len(value) > AUDIT_MAX:
        raise AuditValueError(f"step.audit: {column} is {len(value)} characters; it is 1 to {AUDIT_MAX}")
    if not value.isprintable():
        raise AuditValueError(f"step.audit: {column} {value[:40]!r} contains a NUL, a lone surrogate or an "
                              "unprintable character")


CANVAS_JOB_ID = "system.canvas"
#: The composite kinds a node's ``canvas`` names (a node without it is a task).
KINDS = ("chain", "group", "chord")
#: How deep composites may nest (a chain in a chord in a chain is 3); deeper is refused where built.
MAX_DEPTH = 16
#: Options a member signature may carry (anything else is refused where the signature is built).
MEMBER_OPTIONS = ("countdown", "eta", "priority", "queue", "task_id")


class CanvasError(NonRetriableError, ValueError):
    """A canvas node that cannot run (malformed, too deep, a member that is not a direct job)."""


def member_id(canvas_run_id: uuid.UUID | str, key: str) -> uuid.UUID:
    """The id of the member a canvas run starts at step ``key``: derived, so the producer's
    handle names every member before it exists, and a canvas run never starts two for one key."""
    return uuid.uuid5(uuid.UUID(str(canvas_run_id)), key)


def is_leaf(node: dict[str, Any]) -> bool:
    """A task without callbacks: a member run of its own job (else: a canvas of its own)."""
    return "canvas" not in node and not node.get("link") and not node.get("link_error")


def check_node(node: Any, depth: int = 0) -> None:
    """Refuse a node the canvas job cannot run, naming what is wrong (``CanvasError``)."""
    if depth > MAX_DEPTH:
        raise CanvasError(f"canvas nested more than {MAX_DEPTH} deep")
    if not isinstance(node, dict):
        raise CanvasError(f"a canvas node is a JSON object, got {type(node).__name__}")
    for callbacks in ("link", "link_error"):
        value = node.get(callbacks, [])
        if not isinstance(value, list):
            raise CanvasError(f"{callbacks} of a canvas node is a list")
        for callback in value:
            check_node(callback, depth + 1)
    kind = node.get("canvas")
    if kind is None:
        if not isinstance(node.get("job"), str):
            raise CanvasError("a task node names its job: {'job': <job id>, ...}")
        if not isinstance(node.get("args", []), list) or not isinstance(node.get("kwargs", {}), dict):
            raise CanvasError(f"task {node['job']!r}: args is a list and kwargs an object")
        options = node.get("options", {})
        if not isinstance(options, dict) or set(options) - set(MEMBER_OPTIONS):
            raise CanvasError(f"task {node['job']!r}: options are among {', '.join(MEMBER_OPTIONS)}")
        return
    if kind not in KINDS:
        raise CanvasError(f"unknown canvas kind {kind!r} (one of {', '.join(KINDS)})")
    parts = node.get("header") if kind == "chord" else node.get("tasks")
    if not isinstance(parts, list):
        raise CanvasError(f"a {kind} holds a list of {'header members' if kind == 'chord' else 'tasks'}")
    for part in parts:
        check_node(part, depth + 1)
    if kind == "chord":
        check_node(node.get("body"), depth + 1)
    elif kind == "chain" and not parts:
        raise CanvasError("a chain needs at least one task")
