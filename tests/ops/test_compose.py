"""compose.yaml: valid for docker-compose, and shaped as the operations guide promises.

No container engine runs here, so nothing is started: `docker-compose config`
(Debian's package, installed by .ci/run) validates the file against the Compose
schema and resolves the interpolation; the structure checks below hold the
promises a schema cannot (roles and their passwords, health-gated start order,
loopback-only ports).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
SECRETS = {
    "MOTIR_OWNER_PASSWORD": "owner-pw-1",
    "MOTIR_ENGINE_PASSWORD": "engine-pw-2",
    "MOTIR_APP_PASSWORD": "app-pw-3",
    "MOTIR_ADMIN_PASSWORD": "admin-pw-5",
    "MOTIR_DASHBOARD_SECRET": "dash-secret-4",
}
SERVICES = {"postgres", "redis", "migrate", "worker", "beat", "flower", "dashboard"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is missing in CI: .ci/run installs Debian's docker-compose package")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose); the structure tests still ran")
    return exe


def _config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MOTIR_")}
    return subprocess.run([_docker_compose(), "-f", str(COMPOSE), "config"], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=60, check=False)


def test_docker_compose_config_accepts_the_file_and_interpolates_each_roles_password() -> None:
    result = _config(SECRETS)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert set(resolved["services"]) == SERVICES
    worker_env = resolved["services"]["worker"]["environment"]
    assert worker_env["MOTIR_DATABASE_URL"] == "postgresql+psycopg://motir_engine:engine-pw-2@postgres:5432/motir"
    assert worker_env["MOTIR_APP_DATABASE_URL"] == "postgresql+psycopg://motir_app:app-pw-3@postgres:5432/motir"
    migrate_env = resolved["services"]["migrate"]["environment"]
    assert migrate_env["MOTIR_MIGRATE_DATABASE_URL"] == "postgresql+psycopg://motir_owner:owner-pw-1@postgres:5432/motir"


def test_docker_compose_config_restarts_every_long_running_service_and_lets_the_worker_finish_its_runs() -> None:
    result = _config(SECRETS)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("postgres", "redis", "worker", "beat", "flower", "dashboard"):
        assert services[name]["restart"] == "unless-stopped", name
    assert services["migrate"]["restart"] == "no"
    assert services["worker"]["stop_signal"] == "SIGTERM"  # Celery's warm shutdown
    grace = str(services["worker"]["stop_grace_period"])
    assert grace.endswith("m") or grace.endswith("m0s"), grace  # minutes, not Docker's default 10 s


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_docker_compose_refuses_to_run_without_each_password(missing: str) -> None:
    result = _config({k: v for k, v in SECRETS.items() if k != missing})
    assert result.returncode != 0 and missing in result.stderr


def test_compose_runs_every_component_the_operations_guide_names(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == SERVICES
    commands = {name: " ".join(map(str, svc.get("command", []))) for name, svc in compose["services"].items()}
    assert commands["migrate"].startswith("motir migrate")
    assert commands["worker"].startswith("celery -A motir_celery worker")
    assert commands["beat"].startswith("celery -A motir_celery beat")
    assert commands["flower"].startswith("celery -A motir_celery flower")
    assert commands["dashboard"].startswith("motir dashboard")


def test_services_start_in_order_gated_by_health_and_by_the_migration(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("postgres", "redis", "worker", "flower", "dashboard"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    conditions = {name: {dep: spec["condition"] for dep, spec in svc.get("depends_on", {}).items()}
                  for name, svc in services.items()}
    assert conditions["migrate"] == {"postgres": "service_healthy"}
    for name in ("worker", "beat", "dashboard"):
        assert conditions[name]["migrate"] == "service_completed_successfully", name
    for name in ("worker", "beat", "flower"):
        assert conditions[name]["redis"] == "service_healthy", name
    assert services["migrate"]["restart"] == "no"


def test_each_role_logs_in_with_its_own_password_from_the_environment(compose: dict[str, Any]) -> None:
    text = COMPOSE.read_text()
    logins = dict(re.findall(r"postgresql\+psycopg://(\w+):\$\{(\w+)", text))
    assert logins == {"motir_engine": "MOTIR_ENGINE_PASSWORD", "motir_app": "MOTIR_APP_PASSWORD",
                      "motir_admin": "MOTIR_ADMIN_PASSWORD", "motir_owner": "MOTIR_OWNER_PASSWORD"}
    # No literal password anywhere: every credential is ${VAR:?…}, required at start.
    assert not re.search(r"://\w+:(?!\$\{)[^@\s]+@", text)
    for var in ("MOTIR_OWNER_PASSWORD", "MOTIR_ENGINE_PASSWORD", "MOTIR_APP_PASSWORD", "MOTIR_ADMIN_PASSWORD",
                "MOTIR_DASHBOARD_SECRET"):
        assert f"${{{var}:?" in text, f"{var} is not required"
    services = compose["services"]
    # Only the one-shot migration holds the owner's credentials.
    assert [n for n, s in services.items() if "MOTIR_MIGRATE_DATABASE_URL" in (s.get("environment") or {})] == ["migrate"]
    assert "--set-role-passwords" in services["migrate"]["command"]


def test_published_ports_are_loopback_only_and_the_dashboard_requires_sign_in(compose: dict[str, Any]) -> None:
    services = compose["services"]
    published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
    assert set(published) == {"flower", "dashboard"}
    for name, ports in published.items():
        assert all(str(p).startswith("127.0.0.1:") for p in ports), name
    dash = services["dashboard"]["environment"]
    assert dash["MOTIR_DASHBOARD_AUTH"] == "basic" and dash["MOTIR_DASHBOARD_USERS_FILE"].startswith("/run/secrets/")
    assert "dashboard_users" in compose["secrets"]
    # Only the dashboard holds the admin login; workers never read across workspaces through it.
    assert [n for n, s in services.items() if "MOTIR_ADMIN_DATABASE_URL" in (s.get("environment") or {})] == ["dashboard"]
    # The recipe stores a password hash, never a clear-text password (issue 17).
    header = COMPOSE.read_text().split("x-motir-image")[0]
    assert "hash-password" in header and "openssl rand -hex 12)\" > dashboard-users.txt" not in header


def test_the_image_compose_builds_installs_the_dashboard_and_flower() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert '".[dashboard]"' in dockerfile and "flower" in dockerfile
    assert "USER nobody" in dockerfile
