"""Procrastinate running the same three functions as one task (it stores no steps)."""

from __future__ import annotations

import os

from procrastinate import App, PsycopgConnector

from bench.functions import charge, notify, reserve

app = App(connector=PsycopgConnector(conninfo=os.environ["BENCH_PEER_DSN"]))


@app.task(name="bench.three", queue="bench")
def three(n: int) -> None:
    a = reserve(n)
    b = charge(a["reserved"])
    notify(b["charged"])
