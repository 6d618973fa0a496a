"""Django, first class: examples/django_project against the real Postgres, broker and worker.

Nothing here fakes the database: Django runs in subprocesses of its own (a real
``manage.py runserver`` serving real HTTP requests, ``manage.py`` commands, and
scripts that set Django up), never inside a ``TestCase`` transaction. The project
reaches this session's database through ``DATABASE_URL`` only: motir's database URL
is derived from ``DATABASES['default']`` (MOTIR_DATABASE_URL removed from its
environment). The worker is a real ``celery -A shop worker``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from sqlalchemy import make_url, text

from tests.conftest import ROOT, celery_worker, children, run_state, wait_for
from tests.fixtures import lean_jobs

PROJECT = ROOT / "examples" / "django_project"


def _plain(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="module")
def django_env(database_url: str, broker_url: str) -> dict[str, str]:
    """The environment of every Django process: DATABASE_URL, the broker, the session's queue."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOTIR_", "DJANGO_"))}
    env.update({
        "DATABASE_URL": _plain(database_url),
        "CELERY_BROKER_URL": broker_url,
        "MOTIR_QUEUE": os.environ["MOTIR_QUEUE"],
        "DJANGO_SETTINGS_MODULE": "shop.settings",
        "PYTHONPATH": f"{PROJECT}{os.pathsep}{ROOT}",
    })
    manage(env, "migrate", "--noinput")  # the example's own tables (orders_order)
    return env


def manage(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "manage.py", *args], cwd=PROJECT, env=env, capture_output=True,
                          text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"manage.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def script(env: dict[str, str], code: str, *, expect: int = 0) -> Any:
    """Run ``code`` in a process that set Django up; its last stdout line is JSON."""
    prelude = "import django, json, os, sys\ndjango.setup()\n"
    proc = subprocess.run([sys.executable, "-c", prelude + code], cwd=PROJECT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == expect, f"exited {proc.returncode}, expected {expect}:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


@pytest.fixture(scope="module")
def server(django_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``manage.py runserver`` (no autoreload): the view is reached over HTTP."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("django") / "runserver.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
                                cwd=PROJECT, env=django_env, stdout=fh, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"runserver did not start:\n{log.read_text(errors='replace')}") from None
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def post(base: str, path: str, data: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(base + path, data=urllib.parse.urlencode(data).encode(), method="POST",
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def queued_messages(broker_url: str) -> int:
    """Messages waiting in the session's queue (a Redis list): what the publish sent."""
    return int(redis.Redis.from_url(broker_url).llen(os.environ["MOTIR_QUEUE"]))


def orders_named(engine: Any, item: str) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT id, confirmed_at FROM orders_order WHERE item = :i"), {"i": item}))


def runs_of(engine: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT id, state, result FROM job_queue ORDER BY created_at")))


def django_worker(tmp_path: Path, broker_url: str, django_env: dict[str, str], **kwargs: Any) -> Any:
    env = {k: v for k, v in django_env.items() if k in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE", "PYTHONPATH")}
    # Derived from DATABASES['default'] in the worker too; the job module is found by autodiscovery.
    env.update({"MOTIR_DATABASE_URL": "", "MOTIR_IMPORTS": ""})
    env.update(kwargs.pop("env", {}))
    return celery_worker(tmp_path, broker=broker_url, app="shop", env=env, name="django", **kwargs)


@pytest.fixture(autouse=True)
def _empty_queue(broker_url: str) -> None:
    redis.Redis.from_url(broker_url).delete(os.environ["MOTIR_QUEUE"])


def test_manage_py_commands_read_djangos_settings(django_env, engine):  # type: ignore[no-untyped-def]
    assert "dlq" in manage(django_env, "motir", "--help").stdout  # the motir CLI's own help
    # motir's tables through Django's database settings (the session migrated them already: at head).
    manage(django_env, "motir_migrate")
    assert manage(django_env, "motir_migrate", "--check").returncode == 0
    jobs = manage(django_env, "motir", "jobs").stdout
    assert "orders.confirm" in jobs and "event order.placed" in jobs  # orders/tasks.py, autodiscovered
    checked = manage(django_env, "check")
    assert "no issues" in checked.stdout + checked.stderr
    # An engine URL reaching another database than Django's is worth a warning.
    elsewhere = dict(django_env, MOTIR_DATABASE_URL=_plain(str(engine.url.set(database="postgres"))))
    checked = manage(elsewhere, "check")
    assert "motir.W001" in checked.stdout + checked.stderr


def test_a_rollback_leaves_no_row_and_sends_no_message(server, engine, broker_url):  # type: ignore[no-untyped-def]
    item = f"rollback-{uuid.uuid4().hex[:8]}"
    status, body = post(server, "/orders/", {"item": item, "quantity": 11})  # > 10: the view raises in atomic()
    assert status == 409, body
    assert orders_named(engine, item) == []
    assert runs_of(engine) == []
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_event")).scalar_one() == 0
    assert queued_messages(broker_url) == 0


def test_a_commit_publishes_one_run_that_sees_the_committed_order(  # type: ignore[no-untyped-def]
        server, engine, broker_url, django_env, tmp_path):
    item = f"teapot-{uuid.uuid4().hex[:8]}"
    status, body = post(server, "/orders/", {"item": item, "quantity": 2}, {"X-Shop-Tenant": "acme"})
    assert status == 201, body
    (run_id,), receipt = body["run_ids"], body["receipt_run_id"]  # send_event's run, and .delay()'s
    assert sorted(str(r.id) for r in runs_of(engine)) == sorted([run_id, receipt])
    assert run_state(engine, run_id) == run_state(engine, receipt) == "queued"
    assert queued_messages(broker_url) == 2  # published once the view's transaction committed
    with django_worker(tmp_path, broker_url, django_env) as worker:
        wait_for(lambda: run_state(engine, run_id) == run_state(engine, receipt) == "succeeded",
                 what="the runs on the Django worker")
        processes = [worker.proc.pid, *children(worker.proc.pid)]
        with_sqlalchemy = [pid for pid in processes if lean_jobs.mapped(pid)]
    assert len(processes) == 3 and with_sqlalchemy == []  # a Django-hosted worker's memory has none either
    result = {str(r.id): r.result for r in runs_of(engine)}
    assert result[run_id]["order_id"] == body["order_id"] and result[run_id]["item"] == item
    assert result[run_id]["quantity"] == 2 and result[receipt] == f"receipt: 2 x {item}"
    ((_, confirmed_at),) = orders_named(engine, item)
    assert confirmed_at is not None  # the job's step wrote through Django's ORM in the worker


def test_inside_atomic_the_rows_are_djangos_transaction_outside_it_autocommit(  # type: ignore[no-untyped-def]
        django_env, engine, broker_url):
    seen = script(django_env, f"""
import psycopg, redis
from django.db import connection, transaction
from motir_celery import send_event
from orders.models import Order

other = psycopg.connect(os.environ["DATABASE_URL"], autocommit=True)
queue = redis.Redis.from_url({broker_url!r})
count = "SELECT count(*) FROM job_queue"
out = {{}}
with transaction.atomic():
    order = Order.objects.create(item="inside", workspace="acme")
    sent = send_event("order.placed", {{"order_id": order.pk}}, workspace_id="acme")
    with connection.cursor() as cur:
        cur.execute(count)
        out["own_connection_sees"] = cur.fetchone()[0]
    out["other_connection_sees"] = other.execute(count).fetchone()[0]
    out["messages_before_commit"] = queue.llen(os.environ["MOTIR_QUEUE"])
    out["pending_on_commit"] = len(connection.run_on_commit)
out["after_commit"] = other.execute(count).fetchone()[0]
out["messages_after_commit"] = queue.llen(os.environ["MOTIR_QUEUE"])
send_event("order.placed", {{"order_id": order.pk}}, workspace_id="acme")   # no transaction: autocommit
out["outside"] = other.execute(count).fetchone()[0]
out["messages_outside"] = queue.llen(os.environ["MOTIR_QUEUE"])
transaction.set_autocommit(False)
try:
    send_event("order.placed", {{"order_id": order.pk}}, workspace_id="acme")
except Exception as exc:
    out["manual"] = type(exc).__name__
finally:
    transaction.rollback()
    transaction.set_autocommit(True)
print(json.dumps(out))
""")
    assert seen == {"own_connection_sees": 1, "other_connection_sees": 0, "messages_before_commit": 0,
                    "pending_on_commit": 1, "after_commit": 1, "messages_after_commit": 1,
                    "outside": 2, "messages_outside": 2, "manual": "ConfigurationError"}


def test_the_middleware_scopes_motirs_writes_to_the_requests_workspace(django_env):  # type: ignore[no-untyped-def]
    seen = script(django_env, """
from django.db import connection, transaction
from django.http import JsonResponse
from django.test import RequestFactory
from motir_celery import send_event
from motir_celery.contrib.django.middleware import WorkspaceMiddleware

GUC = "SELECT current_setting('motir.workspace_id', true)"

def view(request):
    with transaction.atomic():
        send_event("order.placed", {"order_id": 0}, workspace_id="acme")
        with connection.cursor() as cur:
            cur.execute(GUC)
            inside = cur.fetchone()[0]
    with connection.cursor() as cur:
        cur.execute(GUC)
        after = cur.fetchone()[0]
    return JsonResponse({"inside": inside, "after": after})

response = WorkspaceMiddleware(view)(RequestFactory().post("/", HTTP_X_SHOP_TENANT="acme"))
seen = json.loads(response.content)
from motir_celery.contrib.django.db import scope_transaction
with transaction.atomic():
    scope_transaction("globex")   # for the project's own reads of motir's tables
    with connection.cursor() as cur:
        cur.execute(GUC)
        seen["scoped"] = cur.fetchone()[0]
print(json.dumps(seen))
""")
    # Set in the transaction motir wrote in; gone with it (never left on the pooled connection).
    assert seen["inside"] == "acme" and seen["after"] in ("", None) and seen["scoped"] == "globex"


def test_killed_between_commit_and_publish_the_sweeper_runs_it(  # type: ignore[no-untyped-def]
        django_env, engine, broker_url, tmp_path):
    item = f"crash-{uuid.uuid4().hex[:8]}"
    # The real view through Django's test client (a real request, the real database); the
    # process dies in transaction.on_commit, after the commit and before the publish.
    script(django_env, f"""
from django.test import Client
from motir_celery.core.producer import events

def die(*_):
    os._exit(17)

events.publish_runs = die
Client().post("/orders/", {{"item": {item!r}, "quantity": 1}})
print("survived")
""", expect=17)
    ((order_id, _),) = orders_named(engine, item)  # committed with the event and both runs
    runs = runs_of(engine)
    assert [r.state for r in runs] == ["queued", "queued"] and queued_messages(broker_url) == 0  # no message went out
    with django_worker(tmp_path, broker_url, django_env, env={"MOTIR_REPUBLISH_AFTER": "1"}):
        wait_for(lambda: all(run_state(engine, r.id) == "succeeded" for r in runs), timeout=30,
                 what="the sweeper to publish the runs")
    results = [r.result for r in runs_of(engine)]
    assert any(isinstance(r, dict) and r["order_id"] == order_id and r["item"] == item for r in results)
    assert f"receipt: 1 x {item}" in results


def test_under_an_app_role_login_postgres_keeps_a_request_to_its_workspace(  # type: ignore[no-untyped-def]
        django_env, engine, database_url):
    """Django logs in as a member of motir_app (RLS enforced): the middleware's workspace is what
    Postgres checks motir's rows against, in Django's transaction."""
    login = f"motir_dj{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{login}" LOGIN IN ROLE motir_app'))
    try:
        env = dict(django_env, DATABASE_URL=_plain(str(make_url(database_url).set(username=login, password=None))),
                   MOTIR_DATABASE_URL=database_url)  # the engine (outside atomic, workers) stays the owner
        seen = script(env, """
from django.db import transaction
from django.http import JsonResponse
from django.test import RequestFactory
from motir_celery import send_event
from motir_celery.contrib.django.middleware import WorkspaceMiddleware

def sender(workspace):
    def view(request):
        try:
            with transaction.atomic():
                return JsonResponse({"runs": len(send_event("order.placed", {"order_id": 0},
                                                            workspace_id=workspace).run_ids)})
        except Exception as exc:
            # Postgres refuses it (insufficient_privilege): the checked write of migration 0008,
            # raised as psycopg raises it on Django's connection
            return JsonResponse({"refused": getattr(exc, "sqlstate", None) == "42501"})
    return view

request = lambda: RequestFactory().post("/", HTTP_X_SHOP_TENANT="acme")
out = {
    "own": json.loads(WorkspaceMiddleware(sender("acme"))(request()).content),
    "other": json.loads(WorkspaceMiddleware(sender("globex"))(request()).content),
    "no_middleware": json.loads(sender("globex")(request()).content),
}
print(json.dumps(out))
""")
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP ROLE IF EXISTS "{login}"'))
    assert seen == {"own": {"runs": 1}, "other": {"refused": True}, "no_middleware": {"runs": 1}}
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT workspace_id FROM job_event ORDER BY received_at")).scalars().all()
    assert rows == ["acme", "globex"]  # the refused one left nothing
