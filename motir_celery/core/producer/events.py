"""``send_event``: write the event and its runs in one transaction, publish after commit.

Fan-out is ``INSERT … ON CONFLICT (event_id, job_id) DO NOTHING``: dispatching
an event twice creates no second run. Subscribers come from the job registry
of the sending process, so a process that sends events imports the job modules
(``MOTIR_IMPORTS``) just as workers do.

An idempotency key is at most 255 printable characters (no NUL, no lone
surrogate: Postgres could not store them). Keys are per workspace: a key reused
for the same event name in the same workspace writes nothing (``deduplicated``);
reused with *different* data it still writes nothing — the first event stands —
but the result says ``conflicting=True`` and a warning is logged: the caller has
two meanings for one key, which is a bug worth hearing about, not one worth an
exception in a retry path (docs/security.md, "Refused inputs"). Another
workspace's use of the same key is invisible and changes nothing.

What an event does to runs already there stays in its workspace too: it wakes
the runs of its own workspace waiting for it and cancels (``cancel_on``) the runs
of its own workspace; a system event (no workspace) acts on system runs only.

Publishing happens strictly **after** the commit that created the rows: a
message can then never name a run that does not exist (or that a rollback
removed). A crash between the commit and the publish leaves a queued run with
no message; the sweeper re-publishes it.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.core.jobs import Job, cancelled_by, subscribers
from motir_celery.core.producer.gather import gather_runs, gathers
from motir_celery.core.producer.results import RunHandle
from motir_celery.core.publish import Publish, publish_or_log
from motir_celery.core.runspec import path_of, value_at
from motir_celery.core.tracing import current_traceparent
from motir_celery.errors import PayloadError
from motir_celery.store import records
from motir_celery.store.db import validate_workspace_id
from motir_celery.store.sql import producer as producer_sql

if TYPE_CHECKING:  # the ORM only for a caller's own Session: a worker never imports it (its memory)
    from sqlalchemy.orm import Session

    from motir_celery.core.engine import Engine
    from motir_celery.store.driver import Conn

__all__ = ["SendResult", "send_event", "dispatch_event", "publish_after_commit", "MAX_IDEMPOTENCY_KEY",
           "validate_event", "write_event", "deduplicated", "cancel_on", "publish_runs"]

log = logging.getLogger("motir_celery.core.producer.events")

#: Longest idempotency key, in characters (a UUID is 36; Stripe's limit is 255 too).
MAX_IDEMPOTENCY_KEY = 255


@dataclass(frozen=True)
class SendResult:
    #: The new event's id; the existing event's id when ``deduplicated``.
    event_id: uuid.UUID | None
    #: One entry per subscribing job: ``Queued(run_id)`` or ``AlreadyQueued``.
    runs: list[records.Queued | records.AlreadyQueued] = field(default_factory=list)
    #: The idempotency key was already used for this event name in this workspace: nothing was written.
    deduplicated: bool = False
    #: Deduplicated, and the stored event's data differ from this call's:
    #: one key was given two meanings. Nothing was written (the first event stands); logged.
    conflicting: bool = False
    #: Runs that were waiting for this event (step.wait_for_event), due now.
    woken: list[records.Queued] = field(default_factory=list)
    #: Runs this event cancelled (cancel_on).
    cancelled: list[uuid.UUID] = field(default_factory=list)
    #: The event's workspace (None: a system event); its runs' handles read there.
    workspace_id: str | None = None
    #: The engine that wrote it (its handles read through it); None: the current one.
    engine: Engine | None = field(default=None, repr=False, compare=False)

    @property
    def run_ids(self) -> list[uuid.UUID]:
        return [r.run_id for r in self.runs if isinstance(r, records.Queued)]

    @property
    def results(self) -> list[RunHandle]:
        """A result handle per run created, or joined (debounce= / batch=: ``Gathered``):
        ``.state``, ``.get(timeout=)`` (core/results.py)."""
        return [RunHandle(r.run_id, r.job_id, workspace_id=self.workspace_id, engine=self.engine)
                for r in self.runs if isinstance(r, (records.Queued, records.Gathered))]


def validate_event(name: Any, data: Any, workspace_id: Any, idempotency_key: Any, limit: int) -> tuple[str, str | None]:
    """Check one event before anything is written: its JSON encoding and its workspace
    (explicit, else the payload's ``workspace_id``). ``PayloadError`` names what is wrong."""
    if not isinstance(name, str) or not name.strip() or len(name) > 200 or not name.isprintable():
        raise PayloadError(f"event name must be a non-empty printable string of at most 200 characters, "
                           f"got {name!r:.80}")
    try:
        encoded = json.dumps(data, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"data of event {name!r} is not JSON ({type(data).__name__}): {exc}") from None
    except RecursionError:
        raise PayloadError(f"data of event {name!r} is nested too deeply to be stored as JSON") from None
    if "\\u0000" in encoded:
        raise PayloadError(f"data of event {name!r} contains a NUL character, which Postgres jsonb cannot store")
    if "\\ud" in encoded:  # a surrogate escape: fine in a pair (non-BMP characters), not alone
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise PayloadError(f"data of event {name!r} contains a lone surrogate (half of a UTF-16 pair), "
                               "which is not Unicode text and which Postgres jsonb cannot store") from None
    if len(encoded) > limit:
        raise PayloadError(f"data of event {name!r} is {len(encoded)} bytes of JSON, over the {limit}-byte limit")
    if workspace_id is None and isinstance(data, dict) and data.get("workspace_id") is not None:
        workspace_id = data["workspace_id"]
    workspace_id = validate_workspace_id(workspace_id)
    if idempotency_key is not None and (
            not isinstance(idempotency_key, str) or not idempotency_key
            or len(idempotency_key) > MAX_IDEMPOTENCY_KEY or not idempotency_key.isprintable()):
        raise PayloadError(f"idempotency_key must be a non-empty string of at most {MAX_IDEMPOTENCY_KEY} printable "
                           f"characters (no NUL, control character or lone surrogate), got {idempotency_key!r:.80}")
    return encoded, workspace_id


def write_event(conn: Conn, name: str, data: Any, encoded: str, workspace_id: str | None,
                idempotency_key: str | None, jobs: Sequence[Job], *, priority: int | None = None,
                traceparent: str | None = None, engine: Engine | None = None) -> SendResult:
    """The event, its runs, and what it does to runs already there — in ``conn``'s
    transaction. On a connection in autocommit only for an event that no
    cancel_on rule listens to (the caller checks): the event is one statement,
    its own transaction, and cancelling would take statements of their own."""
    specs = [job.spec(data, workspace_id, priority) for job in jobs]
    # Runs suspended in step.wait_for_event for this event become due now (woken).
    event_id, runs, woken = producer_sql.record_event(conn, name, encoded, workspace_id, idempotency_key, specs,
                                               traceparent=traceparent)
    if event_id is None:
        return deduplicated(conn, name, encoded, workspace_id, idempotency_key, engine)
    runs = gather_runs(conn, runs, data, workspace_id)  # debounce= / batch=: into the key's open run
    cancelled = cancel_on(conn, name, data, workspace_id)
    return SendResult(event_id, runs, woken=woken, cancelled=cancelled, workspace_id=workspace_id, engine=engine)


def deduplicated(conn: Conn, name: str, encoded: str, workspace_id: str | None,
                 idempotency_key: str | None, engine: Engine | None = None) -> SendResult:
    """The result of an event its idempotency key refused: what the key stands for in this
    workspace, and a warning when the stored event's data differ (one key, two meanings)."""
    existing = producer_sql.existing_event(conn, name, encoded, workspace_id, idempotency_key)
    conflicting = existing is None or not existing["same"]
    if conflicting:
        log.warning("idempotency key %r of event %r was already used in workspace %r with other data: "
                    "nothing was written, the first event stands", idempotency_key, name, workspace_id)
    return SendResult(existing["id"] if existing else None, [], deduplicated=True, conflicting=conflicting,
                      workspace_id=workspace_id, engine=engine)


def cancel_on(conn: Conn, name: str, data: Any, workspace_id: str | None) -> list[uuid.UUID]:
    """Jobs with a cancel_on rule for this event: cancel the runs it matches in its workspace."""
    cancelled: list[uuid.UUID] = []
    for job in cancelled_by(name):
        for rule in job.run_options.cancel_on:
            key = value_at(data, path_of(rule.match)) if rule.event == name else None
            if key is not None:
                within = rule.timeout.total_seconds() if rule.timeout else None
                cancelled += producer_sql.cancel_by_key(conn, job.id, key, within, workspace_id)
    return cancelled


def send_event(
    engine: Engine,
    name: str,
    data: Any,
    *,
    workspace_id: str | None = None,
    idempotency_key: str | None = None,
    session: Session | None = None,
    jobs: Sequence[Job] | None = None,
    priority: int | None = None,
) -> SendResult:
    """Record event ``name`` and create one run per subscribing job.

    With ``session``, the rows are written in that session's transaction and
    the messages are published only if it commits. ``jobs`` restricts the
    fan-out (DLQ replay re-emits an event for one job only).
    """
    publish = engine.publish
    encoded, workspace_id = validate_event(name, data, workspace_id, idempotency_key,
                                           engine.settings.max_payload_bytes)
    if priority is not None and (not isinstance(priority, int) or not 0 <= priority <= 9):
        raise PayloadError(f"priority must be an integer from 0 to 9, got {priority!r}")
    targets = subscribers(name) if jobs is None else list(jobs)
    args = (name, data, encoded, workspace_id, idempotency_key, targets)
    extra: dict[str, Any] = {"priority": priority, "traceparent": current_traceparent(), "engine": engine}
    if session is not None:
        result = write_event(session.connection(), *args, **extra)
        publish_after_commit(session, [*result.runs, *result.woken], publish)
        return result
    joined = engine.joined(workspace_id)
    if joined is not None:
        with joined as (conn, on_commit):
            result = write_event(conn, *args, **extra)
            pending = [*result.runs, *result.woken]
            on_commit(lambda: publish_runs(pending, publish))
        return result
    pool = engine.pool()
    if cancelled_by(name) or gathers(targets):  # statements of their own: one transaction
        with pool.begin() as conn:
            result = write_event(conn, *args, **extra)
        publish_runs([*result.runs, *result.woken], publish)
        return result
    # The common case in one round trip (and the one commit, flushed, that the
    # event needs before it is published): see write_event.
    with pool.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        result = write_event(conn, *args, **extra)
        # Committed already; published before the pool takes the connection back
        # (~0.1 ms of Python at low load, off the run's way to a worker).
        publish_runs([*result.runs, *result.woken], publish)
    return result


def dispatch_event(engine: Engine, event_id: uuid.UUID) -> list[records.Queued | records.AlreadyQueued]:
    """Fan an already-recorded event out to its subscribers again (idempotent)."""
    with engine.pool().begin() as conn:
        row = producer_sql.event_of(conn, event_id)
        if row is None:
            raise LookupError(f"no event {event_id}")
        specs = [job.spec(row["data"], row["workspace_id"]) for job in subscribers(row["name"])]
        runs = producer_sql.fan_out(conn, event_id, specs)
    publish_runs(runs, engine.publish)
    return runs


def publish_runs(runs: Sequence[records.Queued | records.AlreadyQueued], publish: Publish) -> None:
    for run in runs:
        # A refused publish is logged, not raised: the rows are committed and the
        # sweeper publishes what is left (the broker is away; don't wait per run).
        if isinstance(run, records.Queued) and not publish_or_log(publish, run.run_id, run.job_id):
            break


_PENDING = "motir_celery.pending_publish"
_HOOKED = "motir_celery.publish_hooked"


def publish_after_commit(session: Session, runs: Sequence[records.Queued | records.AlreadyQueued],
                         publish: Publish) -> None:
    """Publish ``runs`` when ``session`` commits; forget them if it rolls back."""
    session.info.setdefault(_PENDING, []).extend((publish, run) for run in runs)
    if session.info.get(_HOOKED):
        return
    session.info[_HOOKED] = True
    # Listeners stay for the session's life (removing one while SQLAlchemy
    # dispatches the event is refused); they act only on what is pending.

    def after_commit(sess: Session) -> None:
        for fn, run in sess.info.pop(_PENDING, []):
            publish_runs([run], fn)

    def after_soft_rollback(sess: Session, previous_transaction: Any) -> None:
        # Only the outermost rollback discards the rows (a savepoint rollback may not).
        if previous_transaction.parent is None:
            sess.info.pop(_PENDING, None)

    from sqlalchemy import event as sa_event  # a Session is SQLAlchemy's: imported already

    sa_event.listen(session, "after_commit", after_commit)
    sa_event.listen(session, "after_soft_rollback", after_soft_rollback)
