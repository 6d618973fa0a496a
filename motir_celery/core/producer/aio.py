"""asyncio producers: ``await send_event_async(...)`` and ``await job.delay_async(...)``.

For FastAPI / Starlette / aiohttp code. The rows are written over psycopg's
async connection (SQLAlchemy's async engine on the same ``postgresql+psycopg``
URL), so the event loop runs while Postgres works; the statements are the
catalogue's own (``RECORD_EVENT``, ``DIRECT_RUN``), sent as they are. With
``session=`` an ``AsyncSession`` takes the place of a ``Session``: the rows are
written in its transaction and published when it commits.

The broker publish is synchronous code (kombu, or the Redis lane's LPUSH), so
it runs in the loop's default thread executor, after the commit:

* without ``session``, the call awaits it, so when ``await`` returns the
  message is out, as with ``send_event``;
* with ``session``, the commit hook (SQLAlchemy's ``after_commit``, which runs
  inside ``await session.commit()``) hands it to the executor and returns; the
  executor publishes a moment later. A refused publish is logged, the row is
  committed, the sweeper publishes it.

An async engine's connections belong to the loop that opened them, so there is
one engine per event loop (and per process, ``forks.per_process``).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine

from motir_celery.core.jobs import Job, cancelled_by, subscribers
from motir_celery.core.producer import direct
from motir_celery.core.producer.events import SendResult, cancel_on, deduplicated, publish_after_commit, validate_event
from motir_celery.core.producer.gather import gather_runs, gathers
from motir_celery.core.producer.results import RunHandle
from motir_celery.core.publish import Publish, publish_or_log
from motir_celery.core.tracing import current_traceparent
from motir_celery.errors import PayloadError
from motir_celery.forks import per_process
from motir_celery.settings import Settings
from motir_celery.store import pooler, records
from motir_celery.store.driver import rows_async
from motir_celery.store.sql import producer as producer_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["send_event_async", "apply_async_async", "async_engine"]


class _Engines:
    def __init__(self) -> None:
        self.by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, AsyncEngine]]" = \
            weakref.WeakKeyDictionary()


_engines = per_process(_Engines)


def async_engine(settings: Settings) -> AsyncEngine:
    """This loop's async engine for the database URL (autocommit: one statement, one commit)."""
    url = settings.require_database_url()
    per_loop = _engines().by_loop.setdefault(asyncio.get_running_loop(), {})
    engine = per_loop.get(url)
    if engine is None:
        connect_args: dict[str, Any] = {"application_name": "motir-celery"}
        if not settings.prepared_statements:
            connect_args["prepare_threshold"] = None  # behind a transaction pooler (store/db.py)
        engine = per_loop[url] = create_async_engine(
            url, pool_size=settings.pool_size, max_overflow=settings.pool_size, connect_args=connect_args,
        ).execution_options(isolation_level="AUTOCOMMIT")
        pooler.install(engine.sync_engine, settings)  # behind a transaction pooler: nothing prepared
    return engine


def _offloaded(publish: Publish, loop: asyncio.AbstractEventLoop) -> Publish:
    """``publish`` handed to the loop's thread executor (for commit hooks: fire and log)."""
    pending: set[asyncio.Future[Any]] = set()

    def submit(run_id: Any, job_id: str, countdown: float = 0.0) -> None:
        future = loop.run_in_executor(None, publish_or_log, publish, run_id, job_id, countdown)
        pending.add(future)  # held until done: a dropped future may be collected mid-flight
        future.add_done_callback(pending.discard)

    return submit


def _publish_all(runs: Sequence[Any], publish: Publish) -> None:
    for run in runs:
        if isinstance(run, records.Queued) and not publish_or_log(publish, run.run_id, run.job_id):
            break  # the broker is away: the sweeper publishes the rest


# --- send_event_async -------------------------------------------------------------


async def _write_event(conn: AsyncConnection, name: str, data: Any, encoded: str, workspace_id: str | None,
                       key: str | None, jobs: Sequence[Job], priority: int | None, engine: Engine) -> SendResult:
    """events.write_event, over an async connection."""
    specs = [job.spec(data, workspace_id, priority) for job in jobs]
    params = {"name": name, "data": encoded, "workspace_id": workspace_id, "key": key,
              **producer_sql.spec_params(specs, current_traceparent())}
    found = await rows_async(conn, producer_sql.RECORD_EVENT, params)
    recorded = [r for r in found if not r["woken"]]
    if not recorded:
        return await conn.run_sync(deduplicated, name, encoded, workspace_id, key, engine)
    woken = [records.Queued(r["run_id"], r["job_id"]) for r in found if r["woken"]]
    runs = producer_sql.runs_of(specs, recorded)
    if gathers(jobs):  # debounce= / batch=: into the key's open run
        runs = await conn.run_sync(gather_runs, runs, data, workspace_id)
    cancelled = await conn.run_sync(cancel_on, name, data, workspace_id) if cancelled_by(name) else []
    return SendResult(recorded[0]["event_id"], runs, woken=woken, cancelled=cancelled, workspace_id=workspace_id,
                      engine=engine)


async def send_event_async(
    engine: Engine,
    name: str,
    data: Any,
    *,
    workspace_id: str | None = None,
    idempotency_key: str | None = None,
    session: AsyncSession | None = None,
    priority: int | None = None,
) -> SendResult:
    """``send_event`` for asyncio code; ``session`` is an ``AsyncSession``."""
    settings, publish = engine.settings, engine.publish
    encoded, workspace_id = validate_event(name, data, workspace_id, idempotency_key, settings.max_payload_bytes)
    if priority is not None and (not isinstance(priority, int) or not 0 <= priority <= 9):
        raise PayloadError(f"priority must be an integer from 0 to 9, got {priority!r}")
    args = (name, data, encoded, workspace_id, idempotency_key, subscribers(name), priority, engine)
    loop = asyncio.get_running_loop()
    if session is not None:
        result = await _write_event(await session.connection(), *args)
        publish_after_commit(session.sync_session, [*result.runs, *result.woken], _offloaded(publish, loop))
        return result
    connections = async_engine(settings)
    if cancelled_by(name) or gathers(subscribers(name)):  # the event and what it does, in one transaction
        async with connections.execution_options(isolation_level="READ COMMITTED").begin() as conn:
            result = await _write_event(conn, *args)
    else:
        async with connections.connect() as conn:
            result = await _write_event(conn, *args)
    await loop.run_in_executor(None, _publish_all, [*result.runs, *result.woken], publish)
    return result


# --- job.delay_async ---------------------------------------------------------------


async def apply_async_async(engine: Engine, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any],
                            options: Mapping[str, Any]) -> RunHandle:
    """``direct.apply_async`` for asyncio code; ``session=`` is an ``AsyncSession``."""
    settings = engine.settings
    session: AsyncSession | None = options.get("session")
    call = direct.prepare(job, args, kwargs, {k: v for k, v in options.items() if k != "session"}, settings)
    publish = engine.routed(call.queue, call.priority)
    loop = asyncio.get_running_loop()
    if session is not None:
        written = await _write_direct(await session.connection(), call, settings)
        if direct.should_publish(written, settings):
            run = records.Queued(written.run_id, job.id)  # type: ignore[arg-type]
            publish_after_commit(session.sync_session, [run],
                                 _offloaded(direct.delayed(publish, written.due_in), loop))
        return direct.handle(engine, call, written)
    async with async_engine(settings).connect() as conn:
        written = await _write_direct(conn, call, settings)
    if direct.should_publish(written, settings):
        assert written.run_id is not None  # should_publish: a new run
        await loop.run_in_executor(None, publish_or_log, publish, written.run_id, job.id, max(written.due_in, 0.0))
    return direct.handle(engine, call, written)


async def _write_direct(conn: AsyncConnection, call: direct.DirectCall, settings: Settings) -> direct.Written:
    found = await rows_async(conn, producer_sql.DIRECT_RUN, call.params(settings))
    written = direct.interpret(call, found[0] if found else None)
    if written is not None:
        return written
    again = await rows_async(conn, producer_sql.DIRECT_RUN_EXISTING, call.existing_params())
    return direct.existing(call, again[0] if again else None)
