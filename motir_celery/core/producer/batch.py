"""``send_events``: N events and all their runs in one statement, published after commit.

The set-based twin of ``send_event``: the same validation, workspace rule (explicit,
else the payload's ``workspace_id``), idempotency (per event: a key already used for
that name writes nothing, ``deduplicated``; with other data or workspace also
``conflicting``, logged) and wake-up of the runs waiting for each event — in one call
of ``motir_record_events`` (migration 0006) instead of one round trip per event.
One result per event, in the order given. A key repeated *within* one batch writes
the first event only; the later ones come back ``deduplicated``.

The batch is one transaction: every event is written, or (an error) none.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from motir_celery.core.jobs import cancelled_by, subscribers
from motir_celery.core.producer import events as _events
from motir_celery.core.producer.gather import gather_runs, gathers
from motir_celery.core.tracing import current_traceparent
from motir_celery.errors import PayloadError, WorkspaceError
from motir_celery.store import records
from motir_celery.store.sql import producer as producer_sql

if TYPE_CHECKING:  # the ORM only for a caller's own Session: a worker never imports it (its memory)
    from sqlalchemy.orm import Session

    from motir_celery.core.engine import Engine
    from motir_celery.store.driver import Conn

__all__ = ["send_events", "MAX_BATCH"]

log = logging.getLogger("motir_celery.core.producer.events")

#: The most events one call takes (a statement's arrays stay a few MB at most).
MAX_BATCH = 10_000

EventLike = Mapping[str, Any] | tuple[str, Any]


def _item(i: int, item: EventLike) -> tuple[str, Any, str | None, str | None, int | None]:
    if isinstance(item, tuple) and len(item) == 2:
        return item[0], item[1], None, None, None
    if isinstance(item, Mapping):
        unknown = set(item) - {"name", "data", "workspace_id", "idempotency_key", "priority"}
        if unknown or "name" not in item:
            raise PayloadError(f"send_events: item {i} needs 'name' (and 'data', 'workspace_id', "
                               f"'idempotency_key', 'priority'), got keys {sorted(item)}")
        return (item["name"], item.get("data"), item.get("workspace_id"), item.get("idempotency_key"),
                item.get("priority"))
    raise PayloadError(f"send_events: item {i} must be a (name, data) pair or a mapping, got {type(item).__name__}")


def send_events(engine: Engine, items: Sequence[EventLike], *, session: Session | None = None
                ) -> list[_events.SendResult]:
    """Record every event of ``items`` — ``(name, data)`` pairs or mappings with ``name``,
    ``data`` and optionally ``workspace_id``, ``idempotency_key``, ``priority`` — and one
    run per subscribing job of each, in one statement; publish after commit (with
    ``session``: when that session commits). One ``SendResult`` per item, in order.
    The messages of a batch written here go to the host in one go (``Host.publish_many``:
    one Redis round trip on a plain Redis broker)."""
    settings, publish = engine.settings, engine.publish
    if len(items) > MAX_BATCH:
        raise PayloadError(f"send_events takes at most {MAX_BATCH} events per call, got {len(items)}")
    if not items:
        return []
    rows_in: list[tuple[str, str, str | None, str | None]] = []
    specs = []
    raw = []
    for i, item in enumerate(items):
        name, data, workspace_id, key, priority = _item(i, item)
        try:
            encoded, workspace_id = _events.validate_event(name, data, workspace_id, key, settings.max_payload_bytes)
        except (PayloadError, WorkspaceError) as exc:
            raise type(exc)(f"send_events: item {i}: {exc}") from None
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                     or not 0 <= priority <= 9):
            raise PayloadError(f"send_events: item {i}: priority must be an integer from 0 to 9, got {priority!r}")
        rows_in.append((name, encoded, workspace_id, key))
        specs.append([job.spec(data, workspace_id, priority) for job in subscribers(name)])
        raw.append(data)
    traceparent = current_traceparent()
    cancelling = {name for name in {r[0] for r in rows_in} if cancelled_by(name)}  # cancel_on rules listen
    gathering = any(gathers(subscribers(name)) for name in {r[0] for r in rows_in})  # debounce= / batch=

    def write(conn: Conn) -> list[_events.SendResult]:
        return _write(conn, rows_in, specs, raw, traceparent, cancelling, engine)

    if session is not None:
        results = write(session.connection())
        _events.publish_after_commit(session, _pending(results), publish)
        return results
    joined = engine.joined(rows_in[0][2])
    if joined is not None:
        with joined as (conn, on_commit):
            results = write(conn)
            pending = _pending(results)
            on_commit(lambda: _events.publish_runs(pending, publish))
        return results
    pool = engine.pool()
    if cancelling or gathering:
        with pool.begin() as conn:
            results = write(conn)
    else:
        # One statement: its own transaction in autocommit, committed when it returns.
        with pool.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            results = write(conn)
    runs = [(r.run_id, r.job_id) for r in _pending(results) if isinstance(r, records.Queued)]
    try:
        if runs:
            engine.publish_many(runs)  # through admission's gate (core/admission.py)
    except Exception:  # noqa: BLE001 — committed: the sweeper publishes what is left
        log.warning("could not publish %d run(s) of a batch (committed; the sweeper will re-publish them)",
                    len(runs), exc_info=True)
    return results


def _pending(results: Sequence[_events.SendResult]) -> list[records.Queued | records.AlreadyQueued]:
    return [run for r in results for run in (*r.runs, *r.woken)]


def _write(conn: Conn, rows_in: list[tuple[str, str, str | None, str | None]],
           specs: list[list[records.RunSpec]], raw: list[Any],
           traceparent: str | None, cancelling: set[str], engine: Engine) -> list[_events.SendResult]:
    found = producer_sql.record_events(conn, rows_in, specs, traceparent=traceparent)
    by_event: dict[int, list[dict[str, Any]]] = {}
    woken: list[records.Queued] = []
    for r in found:
        if r["woken"]:
            woken.append(records.Queued(r["run_id"], r["job_id"]))
        else:
            by_event.setdefault(r["idx"], []).append(r)
    dedup = [i for i in range(len(rows_in)) if i + 1 not in by_event]
    existing: dict[int, dict[str, Any]] = {}
    if dedup:
        for r in producer_sql.existing_events(conn, [rows_in[i] for i in dedup]):
            existing[dedup[r["i"] - 1]] = r
    results: list[_events.SendResult] = []
    for i, (name, _encoded, ws, key) in enumerate(rows_in):
        if i + 1 not in by_event:
            seen = existing.get(i)
            conflicting = seen is None or not seen["same"]
            if conflicting:
                log.warning("idempotency key %r of event %r was already used with other data or another "
                            "workspace: nothing was written, the first event stands", key, name)
            results.append(_events.SendResult(seen["id"] if seen else None, [], deduplicated=True, workspace_id=ws,
                                              conflicting=conflicting, engine=engine))
            continue
        made = by_event[i + 1]
        created = {r["job_id"]: r["run_id"] for r in made if r["run_id"] is not None}
        runs: list[records.Queued | records.AlreadyQueued] = [
            records.Queued(created[s.job_id], s.job_id) if s.job_id in created else records.AlreadyQueued(s.job_id)
            for s in specs[i]]
        runs = gather_runs(conn, runs, raw[i], ws)  # debounce= / batch=: into the key's open run
        cancelled = _events.cancel_on(conn, name, raw[i], ws) if name in cancelling else []
        results.append(_events.SendResult(made[0]["event_id"], runs, cancelled=cancelled, workspace_id=ws,
                                          engine=engine))
    # Waiters woken by the batch go with the first event's result (one run may match several events).
    if woken and results:
        first = next((r for r in results if not r.deduplicated), None)
        if first is not None:
            object.__setattr__(first, "woken", woken)
    return results
