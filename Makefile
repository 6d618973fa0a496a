# make run   - the demo, against $MOTIR_DATABASE_URL / $CELERY_BROKER_URL or embedded services
# make test  - pytest (extra arguments: make test PYTEST_ARGS="-k claim -x")
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

# uv compiles .pyc at install time: imports stay fast even under PYTHONDONTWRITEBYTECODE=1,
# and a warm `uv sync` only re-checks them (~0.2s).
export UV_COMPILE_BYTECODE := 1

# $(call with-services,COMMAND): run COMMAND with both service URLs set, embedded where unset.
# The assignment fails the recipe if the helper fails; `eval "$(...)"` alone would not.
define with-services
embedded_env="$$($(PYTHON) -m motir_celery.dev.embedded env)"; eval "$$embedded_env"; $(1)
endef

.PHONY: run test setup stop-embedded

run: setup
	$(call with-services,$(PYTHON) -m motir_celery.dev.demo)

test: setup
	$(call with-services,$(PYTHON) -m pytest $(PYTEST_ARGS))

# The one set-up both targets share: the pinned uv, then .venv exactly as uv.lock says.
setup: $(UV)
	$(UV) sync --locked

$(UV):
	python3 -m venv .tools
	.tools/bin/pip install --quiet uv==$(UV_VERSION)

stop-embedded:
	@if [[ -x $(PYTHON) ]]; then $(PYTHON) -m motir_celery.dev.embedded stop; fi
