# make run   - the demo, against $MOTIR_DATABASE_URL / $CELERY_BROKER_URL or embedded services
# make test  - pytest in 4 parallel sessions (PYTEST_WORKERS=N) (extra arguments: make test PYTEST_ARGS="-k claim -x";
#              one session: PYTEST_WORKERS=0); first installs the Debian packages the tests need when
#              missing (.ci/system-packages: chromium, docker-compose, pgbouncer)
# make lint  - ruff check (the repository) and mypy motir_celery, as CI runs them
# make test-pgbouncer - the worker end-to-end, engine-semantics, canvas, Django, streams and SIGKILL chaos tests again,
#              through a private PgBouncer in transaction pooling (tests/fixtures/pgbouncer.py) with
#              nothing set about it (the engine finds the pooler); a database error in any worker
#              log fails the test
# make test-scale - the long tests make test leaves out (-m scale: a chord of 10,000 on real workers, the
#              chaos beats scenario)
# make celery-suite - the yardstick of issue 43: Celery's own t/integration/test_canvas.py and test_tasks.py
#              (from the installed Celery's sdist) against a real prefork worker and Redis, plain and with
#              durable=True on each task; 20-40 minutes; prints the table, writes docs/celery-suite.md
#              (tests/celery_suite/README.md; extra arguments: make celery-suite CELERY_SUITE_ARGS="-k chord")
#
# Unset service URLs are filled in by `python -m motir_celery.dev.embedded env`, which
# starts embedded Postgres / Redis under $MOTIR_DATA_DIR (default .motir/) and
# leaves them running for the next run; stop them with `make stop-embedded`.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

UV_VERSION := 0.13.8
UV := .tools/bin/uv
PYTHON := .venv/bin/python
PYTEST_ARGS ?=
# Parallel sessions (pytest-xdist): each worker process is a session of its own, with its own
# database and queue (tests/conftest.py). The suite mostly waits on real workers, brokers and
# Postgres, so 4 sessions keep this 2-core machine busy without starving the timing-bound tests.
# --dist loadfile keeps each file's tests, and its module fixtures (a Django server, a standby
# cluster, a PgBouncer), in one session. 0 runs one plain session.
PYTEST_WORKERS ?= 4
PYTEST_XDIST = -n $(PYTEST_WORKERS) --dist loadfile

# uv compiles .pyc at install time: imports stay fast even under PYTHONDONTWRITEBYTECODE=1,
# and a warm `uv sync` only re-checks them (~0.2s).
export UV_COMPILE_BYTECODE := 1

# $(call with-services,COMMAND): run COMMAND with both service URLs set, embedded where unset.
# The assignment fails the recipe if the helper fails; `eval "$(...)"` alone would not.
define with-services
embedded_env="$$($(PYTHON) -m motir_celery.dev.embedded env)"; eval "$$embedded_env"; $(1)
endef

.PHONY: run test test-pgbouncer test-scale celery-suite lint setup system-packages stop-embedded

run: setup
	$(call with-services,$(PYTHON) -m motir_celery.dev.demo)

# The scale tests (-m scale: minutes of one worker on two cores) are a command of their own, as the
# soak and the benchmarks are: make test-scale.
test: system-packages setup
	$(call with-services,$(PYTHON) -m pytest $(PYTEST_XDIST) -m "not scale" --durations=15 $(PYTEST_ARGS))

test-scale: system-packages setup
	$(call with-services,$(PYTHON) -m pytest -m scale $(PYTEST_ARGS))

# Celery's suite is not ours to collect in make test (tests/conftest.py ignores tests/celery_suite): the
# runner downloads it, copies it twice and runs each copy against a worker of its own.
CELERY_SUITE_ARGS ?=
celery-suite: setup
	$(call with-services,$(PYTHON) -m tests.celery_suite --report docs/celery-suite.md $(CELERY_SUITE_ARGS))

# The second pass (CI runs it beside `make test`): the tests whose workers and engine talk to the
# database most, through PgBouncer (pool_mode = transaction, default_pool_size 4) in front of the same
# server, with nothing set about it, as a user leaves it. The session creates, migrates and
# drops its database through it too. The chaos tests of brokers, beats and bad input are not here: they
# test no database path the SIGKILL one does not, nor do the RabbitMQ variants of the end-to-end tests
# (their Redis twins send the same statements), nor test_hot_path.py (bodies that hold the GIL, huge
# errors and step ids, pool types: the worker end-to-end tests send its statements). (Not test_beat.py: its warm_pool helper holds 5
# transactions open at once, one more than the pool.)
PGBOUNCER_TESTS := tests/adapter/test_worker_e2e.py tests/adapter/test_pgbouncer.py \
	tests/store/test_pooler_detection.py tests/chaos/test_chaos_sigkill.py \
	tests/core/test_primitives.py tests/core/test_compose_runs.py tests/core/test_resume.py tests/core/test_direct.py \
	tests/core/test_batch.py tests/core/test_canvas.py tests/contrib/test_django.py \
	tests/adapter/test_streams_e2e.py

test-pgbouncer: system-packages setup
	$(call with-services,MOTIR_TEST_SCAN_WORKER_LOGS=1 $(PYTHON) -m tests.fixtures.pgbouncer run -- \
		$(PYTHON) -m pytest $(PYTEST_XDIST) -m "not amqp and not scale" $(PGBOUNCER_TESTS) $(PYTEST_ARGS))

# Both checks run; either failing fails the target.
lint: setup
	@status=0; \
	.venv/bin/ruff check || status=1; \
	.venv/bin/mypy motir_celery || status=1; \
	if (( status )); then echo "make lint: FAILED (ruff check / mypy motir_celery, above)" >&2; fi; \
	exit $$status

# chromium (the browser tests) and docker-compose: installed with apt-get as root, else
# the command to run is printed and a missing chromium fails here, before pytest starts.
system-packages:
	bash .ci/system-packages

# The one set-up the targets share: the pinned uv, then .venv exactly as uv.lock says. Then the
# bytecode of our own sources (uv compiles the installed packages only): every worker, beat and
# CLI process a test starts would otherwise compile them again (~0.3 s CPU each) whenever
# PYTHONDONTWRITEBYTECODE is set, as on CI. A stale .pyc is never used (Python checks the mtime).
setup: $(UV)
	$(UV) sync --locked
	$(PYTHON) -m compileall -q -j 0 motir_celery tests examples

$(UV):
	python3 -m venv .tools
	.tools/bin/pip install --quiet uv==$(UV_VERSION)

stop-embedded:
	@if [[ -x $(PYTHON) ]]; then $(PYTHON) -m motir_celery.dev.embedded stop; fi
