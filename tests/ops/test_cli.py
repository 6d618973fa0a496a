"""`motir`, the operator CLI: tables by default, --json on request, errors as one line."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import create_engine, make_url, text

from motir_celery.core import jobs as job_registry
from motir_celery.core.jobs import Job
from motir_celery.core.retries import resolve_policy
from motir_celery.ops.cli import main
from motir_celery.settings import reset_settings
from tests.fixtures.ops_helpers import dead_letter, emit, run_event


def motir(*args: str, ok: bool = True) -> Result:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, f"motir {' '.join(args)} exited {result.exit_code}:\n{result.output}"
    return result


@pytest.fixture(scope="module")
def logins(database_url: str):  # type: ignore[no-untyped-def]
    """URLs of two logins of this session's own: a member of motir_app only, a member of motir_admin only
    (roles are cluster-wide; these are dropped at the end). The test server trusts local logins."""
    owner = create_engine(database_url)
    names = [f"motir_t{uuid.uuid4().hex[:8]}_{kind}" for kind in ("app", "admin")]
    with owner.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{names[0]}" LOGIN IN ROLE motir_app'))
        conn.execute(text(f'CREATE ROLE "{names[1]}" LOGIN IN ROLE motir_admin'))
    try:
        yield tuple(make_url(database_url).set(username=n).render_as_string(hide_password=False) for n in names)
    finally:
        from motir_celery.store.db import dispose_engines

        dispose_engines()  # close this process's pooled sessions of these logins first
        with owner.begin() as conn:
            for n in names:
                conn.execute(text(f'DROP ROLE IF EXISTS "{n}"'))
        owner.dispose()


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, database_url: str, broker_url: str):  # type: ignore[no-untyped-def]
    """The CLI reads its settings from the environment, like every motir process."""
    reset_settings()
    yield monkeypatch
    reset_settings()


def test_migrate_is_idempotent_and_check_reports_no_drift(env, engine) -> None:  # type: ignore[no-untyped-def]
    result = motir("migrate")
    assert "is at head" in result.stdout
    assert "upgrading" in result.stderr  # progress on stderr, the outcome on stdout
    assert "no drift" in motir("migrate", "--check").stdout


def test_migrate_set_role_passwords_gives_both_roles_login_from_the_environment(env, engine, database_url) -> None:  # type: ignore[no-untyped-def]
    missing = motir("migrate", "--set-role-passwords", ok=False)
    assert missing.exit_code != 0 and "MOTIR_APP_PASSWORD" in missing.output
    env.setenv("MOTIR_APP_PASSWORD", "app-secret-" + uuid.uuid4().hex[:6])
    env.setenv("MOTIR_ENGINE_PASSWORD", "engine-secret-" + uuid.uuid4().hex[:6])
    # The roles are cluster-wide: remember them exactly (a superuser reads the stored hash) to restore them.
    with engine.connect() as conn:
        before = conn.execute(text("SELECT rolname, rolcanlogin, rolpassword FROM pg_authid "
                                   "WHERE rolname IN ('motir_app', 'motir_engine')")).all()
    try:
        result = motir("migrate", "--set-role-passwords")
        assert "role motir_app: LOGIN" in result.stdout and "role motir_engine: LOGIN" in result.stdout
        assert "secret" not in result.output  # passwords are never echoed
        for role, var in (("motir_app", "MOTIR_APP_PASSWORD"), ("motir_engine", "MOTIR_ENGINE_PASSWORD")):
            import os

            url = make_url(database_url).set(username=role, password=os.environ[var])
            login = create_engine(url)
            with login.connect() as conn:
                assert conn.execute(text("SELECT current_user")).scalar_one() == role
            login.dispose()
    finally:
        with engine.begin() as conn:
            raw = conn.connection.driver_connection
            for role in before:
                from psycopg import sql

                # ALTER ROLE … PASSWORD accepts a stored SCRAM/MD5 hash as it is.
                stmt = sql.SQL("ALTER ROLE {} {} PASSWORD {}").format(
                    sql.Identifier(role.rolname), sql.SQL("LOGIN" if role.rolcanlogin else "NOLOGIN"),
                    sql.Literal(role.rolpassword))
                conn.exec_driver_sql(stmt.as_string(raw))
        with engine.connect() as conn:
            after = conn.execute(text("SELECT rolname, rolcanlogin, rolpassword FROM pg_authid "
                                      "WHERE rolname IN ('motir_app', 'motir_engine')")).all()
        assert sorted(after) == sorted(before)


def test_send_queues_one_run_per_subscriber_and_runs_list_shows_them(env, engine) -> None:  # type: ignore[no-untyped-def]
    sent = motir("send", "test.mixed", "--data", '{"switch": "s1"}', "--workspace", "ws-cli", "--json")
    payload = json.loads(sent.stdout)
    assert {r["job_id"] for r in payload["runs"]} == {"test.mixed-ok", "test.mixed-fail"}
    assert all(r["status"] == "queued" for r in payload["runs"])

    table = motir("runs", "list").stdout
    header, *rows = table.splitlines()
    assert header.split() == ["RUN", "JOB", "WORKSPACE", "STATE", "ATTEMPTS", "CREATED", "TOOK"]
    assert len(rows) == 2 and all("ws-cli" in r and "queued" in r for r in rows)

    listed = json.loads(motir("runs", "list", "--job", "test.mixed-ok", "--json").stdout)
    assert [r["job_id"] for r in listed] == ["test.mixed-ok"]
    assert listed[0]["workspace_id"] == "ws-cli" and listed[0]["state"] == "queued"


def test_send_with_a_used_idempotency_key_runs_nothing_new(env, engine) -> None:  # type: ignore[no-untyped-def]
    motir("send", "test.three", "--key", "order-7")
    again = motir("send", "test.three", "--key", "order-7")
    assert "deduplicated" in again.stdout
    assert len(json.loads(motir("runs", "list", "--json").stdout)) == 1


def test_send_rejects_data_that_is_not_json(env, engine) -> None:  # type: ignore[no-untyped-def]
    result = motir("send", "test.three", "--data", "{nope", ok=False)
    assert result.exit_code == 2 and "not JSON" in result.output


def test_runs_list_filters_by_state_workspace_and_since(env, engine) -> None:  # type: ignore[no-untyped-def]
    run_event("test.three", {"workspace_id": "ws-a"})
    emit("test.three", {"workspace_id": "ws-b"})
    assert [r["workspace_id"] for r in json.loads(motir("runs", "list", "--state", "succeeded", "--json").stdout)] == ["ws-a"]
    assert [r["state"] for r in json.loads(motir("runs", "list", "--workspace", "ws-b", "--json").stdout)] == ["queued"]
    assert len(json.loads(motir("runs", "list", "--since", "1h", "--json").stdout)) == 2
    assert json.loads(motir("runs", "list", "--since", "2999-01-01", "--json").stdout) == []
    bad = motir("runs", "list", "--since", "yesterday-ish", ok=False)
    assert bad.exit_code == 2 and "30m, 2h, 7d" in bad.output


def test_runs_show_gives_steps_with_timings_and_outputs_and_attempts_with_errors_and_workers(env, engine) -> None:  # type: ignore[no-untyped-def]
    (run_id,) = run_event("test.flaky", {"workspace_id": "ws-a"}).values()
    out = motir("runs", "show", str(run_id), "--traceback").stdout
    assert f"{run_id}  succeeded" in out
    assert "2 of 3 (fast policy)" in out
    steps = out.split("steps (3)")[1].split("attempts (2)")[0]
    assert [line.split()[0] for line in steps.strip().splitlines()[1:]] == ["a", "b", "c"]
    attempts = out.split("attempts (2)")[1]
    assert "retrying" in attempts and "RuntimeError: first attempt fails after step b" in attempts
    assert "ops-test@host/1" in attempts  # the worker of each attempt
    assert "Traceback (most recent call last)" in out

    detail = json.loads(motir("runs", "show", str(run_id), "--json").stdout)
    assert [(s["step_id"], s["attempt"], s["output"]) for s in detail["steps"]] == [("a", 1, 1), ("b", 1, 2), ("c", 2, 3)]
    assert all(s["duration"] >= 0 for s in detail["steps"])
    assert [(a["attempt"], a["outcome"]) for a in detail["attempts"]] == [(1, "retrying"), (2, "succeeded")]
    assert detail["attempts"][0]["error"]["type"] == "builtins.RuntimeError"


def test_runs_show_explains_a_bad_or_unknown_id_in_one_line(env, engine) -> None:  # type: ignore[no-untyped-def]
    bad = motir("runs", "show", "not-a-uuid", ok=False)
    assert bad.exit_code == 2 and "is not a run id" in bad.output
    unknown = motir("runs", "show", str(uuid.uuid4()), ok=False)
    assert unknown.exit_code == 1 and "no run" in unknown.output and "Traceback" not in unknown.output


def test_dlq_list_and_replay_records_who_replayed_and_refuses_a_second_replay(env, engine) -> None:  # type: ignore[no-untyped-def]
    _, dlq_id = dead_letter(engine, "ws-a")
    listed = motir("dlq", "list").stdout
    assert str(dlq_id) in listed and "test.mixed-fail" in listed and "the dependency is broken" in listed

    missing_actor = motir("dlq", "replay", str(dlq_id), ok=False)
    assert missing_actor.exit_code == 2 and "--actor" in missing_actor.output

    replayed = json.loads(motir("dlq", "replay", str(dlq_id), "--actor", "alice", "--json").stdout)
    assert replayed["status"] == "replayed"
    with engine.connect() as conn:
        row = conn.execute(text("SELECT replayed_by, replay_run_id FROM job_run_dlq WHERE id = :i"), {"i": dlq_id}).one()
        new_job = conn.execute(text("SELECT job_id FROM job_queue WHERE id = :r"), {"r": row.replay_run_id}).scalar()
    assert row.replayed_by == "alice" and str(row.replay_run_id) == replayed["run_id"]
    assert new_job == "test.mixed-fail"  # the failed job only, not the event's other subscriber

    again = motir("dlq", "replay", str(dlq_id), "--actor", "bob")  # idempotent: says so, runs nothing
    assert f"already replayed earlier: run {replayed['run_id']}" in again.stdout
    assert "no open entries" in motir("dlq", "list").stdout
    assert "replayed by alice" in motir("dlq", "list", "--all").stdout


def test_dlq_dismiss_closes_an_entry_without_a_run(env, engine) -> None:  # type: ignore[no-untyped-def]
    _, dlq_id = dead_letter(engine, "ws-a")
    assert "dismissed by carol" in motir("dlq", "dismiss", str(dlq_id), "--actor", "carol").stdout
    assert motir("dlq", "replay", str(dlq_id), "--actor", "dave", ok=False).exit_code == 1


def test_cancel_stops_a_queued_run_and_explains_why_a_finished_one_cannot_be(env, engine) -> None:  # type: ignore[no-untyped-def]
    (queued,) = emit("test.three", {}).values()
    assert f"cancelled {queued}" in motir("cancel", str(queued)).stdout
    assert json.loads(motir("runs", "show", str(queued), "--json").stdout)["run"]["state"] == "cancelled"
    (done,) = run_event("test.three", {}).values()
    refused = motir("cancel", str(done), ok=False)
    assert refused.exit_code == 1 and "already succeeded" in refused.output


def test_jobs_lists_triggers_retry_policies_and_next_cron_slots_in_words(env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    nightly = Job(id="test.cli-weekday-report", handler=lambda e, s: None, cron="30 6 * * 1-5",
                  timezone="Europe/Paris", retry_policy=resolve_policy("idempotent"))
    monkeypatch.setitem(job_registry._registry, nightly.id, nightly)  # this test only
    out = motir("jobs").stdout
    line = next(x for x in out.splitlines() if x.startswith("test.cli-weekday-report"))
    assert "cron 30 6 * * 1-5 (Europe/Paris) — at 06:30 on Monday-Friday" in line
    assert "idempotent: 5 attempts, backoff 30.0s ×3" in line
    assert line.count("(") >= 4 and " in " in line  # "in 3h 12m (Tue 06:30 CET), …"
    three = next(x for x in out.splitlines() if x.startswith("test.three-steps"))
    assert "event test.three" in three and "fast: 3 attempts" in three

    as_json = {j["id"]: j for j in json.loads(motir("jobs", "--json").stdout)}
    slots = as_json["test.cli-weekday-report"]["next_slots"]
    assert len(slots) == 3 and all(s.endswith(("+01:00", "+02:00")) and "T06:30:00" in s for s in slots)
    assert as_json["test.three-steps"]["events"] == ["test.three"]


def _checks(result: Result) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in json.loads(result.stdout)["checks"]}


def test_doctor_reports_every_check_with_ok_or_fail_and_a_fix(env, engine) -> None:  # type: ignore[no-untyped-def]
    result = motir("doctor", "--timeout", "1", ok=False)  # no worker runs here: that check fails
    assert result.exit_code == 1
    for name in ("database", "migrations", "roles", "row-level security", "broker", "workers", "sweeper", "queue"):
        assert any(line.split("  ")[0] in ("OK", "FAIL", "WARN") and name in line for line in result.stdout.splitlines()), name
    checks = _checks(motir("doctor", "--timeout", "1", "--json", ok=False))
    assert {n: c["status"] for n, c in checks.items() if n != "workers"} == {
        "database": "OK", "migrations": "OK", "roles": "OK", "row-level security": "WARN",
        "sweeper": "OK", "queue": "OK", "dlq": "OK", "broker": "OK"}
    assert checks["workers"]["status"] == "FAIL" and "celery -A motir_celery worker" in checks["workers"]["fix"]
    # No MOTIR_APP_DATABASE_URL: the engine's login drops to motir_app, and RESET ROLE undoes it.
    # Development mode works as intended: a WARN with its reason (doctor --strict fails on it).
    rls_check = checks["row-level security"]
    assert "development mode" in rls_check["detail"] and "enforced for motir_app" in rls_check["detail"]
    assert "superuser" in rls_check["detail"] and "MOTIR_APP_DATABASE_URL" in rls_check["fix"]
    assert "--strict" in rls_check["fix"]
    # Every check that is not OK says what to do.
    assert all(c["fix"] for c in checks.values() if c["status"] != "OK"), checks


def test_doctor_says_ok_for_rls_only_with_app_and_admin_logins_that_cannot_leave_their_roles(
        env, engine, logins) -> None:  # type: ignore[no-untyped-def]
    app_url, admin_url = logins
    env.setenv("MOTIR_APP_DATABASE_URL", app_url)
    reset_settings()
    checks = _checks(motir("doctor", "--timeout", "1", "--json", ok=False))
    assert checks["row-level security"]["status"] == "WARN"  # no admin URL: admin reads are refused
    assert "MOTIR_ADMIN_DATABASE_URL" in checks["row-level security"]["fix"]
    env.setenv("MOTIR_ADMIN_DATABASE_URL", admin_url)
    reset_settings()
    checks = _checks(motir("doctor", "--timeout", "1", "--json", ok=False))
    assert checks["row-level security"]["status"] == "OK", checks["row-level security"]
    assert "cannot leave it" in checks["row-level security"]["detail"]
    env.setenv("MOTIR_APP_DATABASE_URL", admin_url)  # an admin member as the app login: it could self-grant
    reset_settings()
    checks = _checks(motir("doctor", "--timeout", "1", "--json", ok=False))
    assert checks["row-level security"]["status"] == "FAIL" and "motir_admin" in checks["row-level security"]["detail"]


def test_doctor_is_all_ok_with_a_worker_that_consumes_the_queue_and_knows_the_jobs(
        env, engine, broker_url, tmp_path, monkeypatch, logins) -> None:  # type: ignore[no-untyped-def]
    from motir_celery.core.jobs import all_jobs
    from motir_celery.ops import doctor
    from tests.conftest import celery_worker

    env.setenv("MOTIR_APP_DATABASE_URL", logins[0])  # production shape: RLS read through logins of their own
    env.setenv("MOTIR_ADMIN_DATABASE_URL", logins[1])
    reset_settings()

    # Other test modules register jobs in this process that the test worker (tests.fixtures.jobs) never imports.
    mine = [j for j in all_jobs() if j.handler.__module__ in ("tests.fixtures.jobs", "motir_celery.core.system_jobs")]
    monkeypatch.setattr(doctor, "all_jobs", lambda: mine)
    # (--timeout 3: each call waits that long for ping replies; a loaded machine needs more than 1 s)
    with celery_worker(tmp_path, broker=broker_url, concurrency=1):
        result = motir("doctor", "--timeout", "3", "--strict")  # exit 0: even a deploy pipeline's gate passes
        env.delenv("MOTIR_APP_DATABASE_URL")  # development mode, as `make run` and the examples
        env.delenv("MOTIR_ADMIN_DATABASE_URL")
        reset_settings()
        dev = motir("doctor", "--timeout", "3")  # a WARN: exit 0
        dev_strict = motir("doctor", "--timeout", "3", "--strict", "--json", ok=False)
        # A worker that answers the ping but whose `inspect registered` reply comes too late:
        # doctor cannot tell which jobs it knows, and says so (a WARN), not "none knows" (a FAIL).
        from celery.app.control import Inspect

        monkeypatch.setattr(Inspect, "registered", lambda self, *a, **k: {})
        late = json.loads(motir("doctor", "--timeout", "1", "--json").stdout)
    assert "FAIL" not in result.stdout and "WARN" not in result.stdout, result.stdout
    assert "OK    workers" in result.stdout and "motir job(s) registered" in result.stdout
    assert dev.exit_code == 0 and "FAIL" not in dev.stdout, dev.stdout
    assert re.search(r"WARN\s+row-level security\s+development mode", dev.stdout), dev.stdout
    assert dev_strict.exit_code == 1, dev_strict.output
    report = json.loads(dev_strict.stdout)
    assert report["ok"] is False and report["strict"] is True
    assert [c["name"] for c in report["checks"] if c["status"] != "OK"] == ["row-level security"], report
    (workers,) = [c for c in late["checks"] if c["name"] == "workers"]
    assert workers["status"] == "WARN" and "none is seen to know" in workers["detail"], workers
    assert "inspect registered` within 1s, so this may be wrong" in workers["detail"] and "--timeout" in workers["fix"]


def test_doctor_blames_the_sweeper_for_a_lease_that_expired_long_ago_and_reports_the_oldest_due_run(env, engine) -> None:  # type: ignore[no-untyped-def]
    (stuck,) = emit("test.three", {}).values()
    (waiting,) = emit("test.slow", {}).values()
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET state = 'running', attempts = 1, claim_token = gen_random_uuid(), "
                          "lease_expires_at = now() - interval '1 hour' WHERE id = :r"), {"r": stuck})
        conn.execute(text("UPDATE job_queue SET run_at = now() - interval '20 minutes', "
                          "dispatched_at = now() - interval '20 minutes' WHERE id = :r"), {"r": waiting})
    checks = _checks(motir("doctor", "--timeout", "1", "--json", ok=False))
    assert checks["sweeper"]["status"] == "FAIL"
    assert "lease expired" in checks["sweeper"]["detail"] and "worker" in checks["sweeper"]["fix"]
    assert checks["queue"]["status"] == "FAIL" and "20m" in checks["queue"]["detail"]


def test_doctor_fails_fast_with_a_fix_when_the_database_is_unreachable(env) -> None:  # type: ignore[no-untyped-def]
    env.setenv("MOTIR_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1:1/nothing")
    reset_settings()
    checks = _checks(motir("doctor", "--timeout", "1", "--json", ok=False))
    assert checks["database"]["status"] == "FAIL" and "MOTIR_DATABASE_URL" in checks["database"]["fix"]
    assert checks["migrations"]["detail"].startswith("skipped")
    assert checks["broker"]["status"] == "OK"  # the other half is still checked


def test_commands_turn_an_unreachable_database_into_one_line(env) -> None:  # type: ignore[no-untyped-def]
    env.setenv("MOTIR_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1:1/nothing")
    reset_settings()
    result = motir("runs", "list", ok=False)
    assert result.exit_code == 1 and "database unreachable" in result.output and "Traceback" not in result.output


def test_purge_shows_progress_on_stderr_and_a_summary_table(env, engine) -> None:  # type: ignore[no-untyped-def]
    for _ in range(3):
        run_event("test.three", {})
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET finished_at = now() - interval '40 days'"))
        conn.execute(text("UPDATE job_event SET received_at = now() - interval '40 days'"))
    dry = motir("purge", "--older-than", "30d", "--dry-run")
    assert "WOULD DELETE" in dry.stdout and json.loads(
        motir("purge", "--older-than", "30d", "--dry-run", "--json").stdout)["runs"] == 3
    result = motir("purge", "--older-than", "30d", "--batch-size", "2")
    assert "runs: 2 deleted so far" in result.stderr and "runs: 3 deleted so far" in result.stderr
    summary = {line.rsplit(None, 1)[0].strip(): line.rsplit(None, 1)[1] for line in result.stdout.splitlines()[1:6]}
    assert summary == {"runs": "3", "steps": "9", "attempts": "3", "closed DLQ entries": "0", "events": "3"}
    bad = motir("purge", "--older-than", "thirty days", ok=False)
    assert bad.exit_code == 2 and "30d" in bad.output


def test_dashboard_binds_to_loopback_and_refuses_another_address_without_a_named_proxy_or_in_dev_mode(
        env, monkeypatch, logins) -> None:  # type: ignore[no-untyped-def]
    import uvicorn

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(kw))
    motir("dashboard")
    assert calls[-1]["host"] == "127.0.0.1"
    refused = motir("dashboard", "--host", "0.0.0.0", ok=False)
    assert refused.exit_code == 1 and "MOTIR_DASHBOARD_TRUSTED_PROXIES" in refused.output and len(calls) == 1
    env.setenv("MOTIR_DASHBOARD_TRUSTED_PROXIES", "10.0.0.0/8")
    dev = motir("dashboard", "--host", "0.0.0.0", ok=False)  # no MOTIR_APP_DATABASE_URL: development mode
    assert dev.exit_code == 1 and "development mode" in dev.output and len(calls) == 1
    env.setenv("MOTIR_APP_DATABASE_URL", logins[0])
    reset_settings()
    motir("dashboard", "--host", "0.0.0.0")
    assert calls[-1]["host"] == "0.0.0.0" and calls[-1]["proxy_headers"] is False


def test_dashboard_hash_password_prints_a_hash_the_users_file_accepts(env) -> None:  # type: ignore[no-untyped-def]
    from motir_celery.ops.dashboard.passwords import verify_password

    result = CliRunner().invoke(main, ["dashboard", "hash-password", "--stdin"], input="s3cret:pw\n")
    assert result.exit_code == 0, result.output
    stored = result.stdout.strip()
    assert stored.startswith("$argon2id$") and "s3cret" not in stored
    assert verify_password(stored, "s3cret:pw") and not verify_password(stored, "s3cret")
    scrypt = CliRunner().invoke(main, ["dashboard", "hash-password", "--stdin", "--scheme", "scrypt"], input="pw\n")
    assert scrypt.stdout.startswith("$scrypt$") and verify_password(scrypt.stdout.strip(), "pw")


@pytest.mark.parametrize("args,named", [
    (["runs", "list", "--since", "99999999999d"], "--since"),
    (["runs", "list", "--since", "9" * 400 + "d"], "--since"),
    (["runs", "list", "--job", "j" * 5000], "--job"),
    (["runs", "list", "--workspace", "ws\x01a"], "--workspace"),
    (["dlq", "list", "--job", "x" * 201], "--job"),
    (["purge", "--older-than", "99999999999d", "--dry-run"], "--older-than"),
    (["doctor", "--max-wait", "1e400s"], "--max-wait"),
    (["doctor", "--timeout", "nan"], "--timeout"),
    (["dlq", "dismiss", str(uuid.uuid4()), "--actor", " "], "--actor"),
])
def test_out_of_range_or_unusable_options_are_refused_in_one_line_naming_the_option(
        env, engine, args, named) -> None:  # type: ignore[no-untyped-def]
    result = motir(*args, ok=False)
    assert result.exit_code == 2 and named in result.output and "Traceback" not in result.output, result.output
    assert len([line for line in result.output.splitlines() if line.startswith("Error")]) == 1


@pytest.mark.parametrize("args,said", [
    (["send", "test.three", "--data", '{"a": "\\ud800"}'], "lone surrogate"),
    (["send", "test.three", "--key", "k" * 10_000], "idempotency_key"),
])
def test_send_refuses_what_postgres_could_not_store_in_one_line(env, engine, args, said) -> None:  # type: ignore[no-untyped-def]
    result = motir(*args, ok=False)
    assert result.exit_code == 1 and said in result.output and "Traceback" not in result.output, result.output
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_event")).scalar_one() == 0


def test_doctor_reads_the_schema_version_with_a_real_engine_login(env, engine, database_url) -> None:  # type: ignore[no-untyped-def]
    owner = create_engine(database_url)
    name = f"motir_t{uuid.uuid4().hex[:8]}_engine"
    with owner.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{name}" LOGIN IN ROLE motir_engine'))
    try:
        env.setenv("MOTIR_DATABASE_URL", make_url(database_url).set(username=name).render_as_string(hide_password=False))
        reset_settings()
        checks = _checks(motir("doctor", "--timeout", "1", "--json", ok=False))
        # Before 0007 the engine role could not read alembic_version: "permission denied".
        assert checks["migrations"]["status"] == "OK", checks["migrations"]
    finally:
        from motir_celery.store.db import dispose_engines

        dispose_engines()
        with owner.begin() as conn:
            conn.execute(text(f'DROP ROLE IF EXISTS "{name}"'))
        owner.dispose()
