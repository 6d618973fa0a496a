# The image compose.yaml runs for migrate, worker, beat, flower and the dashboard.
# Your jobs: build FROM this image, COPY your package in, and set MOTIR_IMPORTS.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY motir_celery ./motir_celery
COPY migrations ./migrations
# The dashboard extra (Starlette, Jinja2, uvicorn, prometheus-client) and Flower.
RUN pip install ".[dashboard]" "flower>=2,<3"

# Nothing here needs root; Celery refuses to run pickle-accepting workers as root anyway.
USER nobody
