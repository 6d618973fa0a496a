"""The Insights page's charts, drawn on the server as inline SVG: no script, no front-end build.

Each function turns numbers into shapes (``x``, ``y``, ``w``, ``h`` in the SVG's own units,
and a CSS class that the stylesheet colours): the template only writes them out, so the
page stays within the dashboard's Content-Security-Policy (no inline style, no script) and
reads the same in any browser, and in a screenshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Sequence

from motir_celery.ops.insights import JobStats, Point
from motir_celery.ops.timefmt import format_duration
from motir_celery.store.records import DURATION_BOUNDS_MS

__all__ = ["Bar", "Chart", "runs_chart", "sparkline", "histogram_chart", "rate_bars"]


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    w: float
    h: float
    kind: str
    title: str = ""


@dataclass
class Chart:
    width: float
    height: float
    bars: list[Bar] = field(default_factory=list)
    #: Axis labels: (x, y, text, anchor).
    labels: list[tuple[float, float, str, str]] = field(default_factory=list)
    #: Grid lines: (x1, y1, x2, y2).
    lines: list[tuple[float, float, float, float]] = field(default_factory=list)
    peak: int = 0


def _steps(since: datetime, now: datetime, step: float) -> list[datetime]:
    """The chart's slots: step-aligned instants from the one holding ``since`` to the one holding ``now``."""
    origin = datetime(2000, 1, 1, tzinfo=since.tzinfo)
    first = origin + timedelta(seconds=((since - origin).total_seconds() // step) * step)
    slots, at = [], first
    while at <= now:
        slots.append(at)
        at += timedelta(seconds=step)
    return slots


def _merged(series: dict[str, list[Point]]) -> dict[datetime, list[int]]:
    out: dict[datetime, list[int]] = {}
    for points in series.values():
        for p in points:
            acc = out.setdefault(p.at, [0, 0, 0])
            acc[0] += p.succeeded
            acc[1] += p.failed
            acc[2] += p.cancelled
    return out


def runs_chart(series: dict[str, list[Point]], since: datetime, now: datetime, step: float, *,
               width: float = 900, height: float = 150) -> Chart:
    """Runs finished per step, every job together: succeeded, failed and cancelled stacked."""
    slots = _steps(since, now, step)
    merged = _merged(series)
    left, bottom, top = 40.0, 18.0, 6.0
    plot_w, plot_h = width - left - 4, height - bottom - top
    peak = max((sum(merged.get(s, [0, 0, 0])) for s in slots), default=0)
    chart = Chart(width, height, peak=peak)
    scale = plot_h / peak if peak else 0.0
    slot_w = plot_w / max(len(slots), 1)
    for i, slot in enumerate(slots):
        ok, bad, gone = merged.get(slot, [0, 0, 0])
        x, y = left + i * slot_w, top + plot_h
        for n, kind in ((ok, "succeeded"), (bad, "failed"), (gone, "cancelled")):
            if n:
                h = max(n * scale, 1.0)
                y -= h
                chart.bars.append(Bar(round(x + 1, 1), round(y, 1), round(max(slot_w - 2, 1), 1), round(h, 1), kind,
                                      f"{slot:%Y-%m-%d %H:%M}: {n} {kind}"))
    for frac in (0.0, 0.5, 1.0):
        y = round(top + plot_h * (1 - frac), 1)
        chart.lines.append((left, y, width - 4, y))
        chart.labels.append((left - 4, y + 4, f"{round(peak * frac):d}", "end"))
    marks = max(len(slots) // 6, 1)
    for i in range(0, len(slots), marks):
        fmt = "%H:%M" if step < 86400 / 4 else "%a %H:%M"
        chart.labels.append((round(left + (i + 0.5) * slot_w, 1), height - 4, f"{slots[i]:{fmt}}", "middle"))
    return chart


def sparkline(points: Sequence[Point], since: datetime, now: datetime, step: float, *,
              width: float = 160, height: float = 28) -> Chart:
    """One job's runs per step, a small stacked bar per slot (failed on top, in red)."""
    slots = _steps(since, now, step)
    by = {p.at: p for p in points}
    peak = max((by[s].succeeded + by[s].failed + by[s].cancelled for s in slots if s in by), default=0)
    chart = Chart(width, height, peak=peak)
    slot_w = width / max(len(slots), 1)
    scale = (height - 2) / peak if peak else 0.0
    for i, slot in enumerate(slots):
        p = by.get(slot)
        if p is None:
            continue
        y = height
        for n, kind in ((p.succeeded, "succeeded"), (p.failed, "failed"), (p.cancelled, "cancelled")):
            if n:
                h = max(n * scale, 1.0)
                y -= h
                chart.bars.append(Bar(round(i * slot_w, 2), round(y, 2), round(max(slot_w - 0.6, 0.6), 2),
                                      round(h, 2), kind, f"{slot:%m-%d %H:%M}: {n} {kind}"))
    return chart


def histogram_chart(stats: JobStats, *, width: float = 900, height: float = 130) -> Chart:
    """A job's succeeded-run durations over the rollup's buckets (one bar per bucket that has any)."""
    hist = list(stats.histogram)
    used = [i for i, n in enumerate(hist) if n]
    chart = Chart(width, height, peak=max(hist, default=0))
    if not used:
        return chart
    lo, hi = used[0], used[-1]
    shown = list(range(lo, hi + 1))
    left, bottom, top = 40.0, 30.0, 6.0
    plot_w, plot_h = width - left - 4, height - bottom - top
    bar_w = plot_w / len(shown)
    peak = max(hist[i] for i in shown)
    for j, i in enumerate(shown):
        n = hist[i]
        h = n / peak * plot_h if peak else 0
        label = _bucket_label(i)
        if n:
            chart.bars.append(Bar(round(left + j * bar_w + 1, 1), round(top + plot_h - h, 1),
                                  round(max(bar_w - 2, 1), 1), round(max(h, 1.0), 1), "duration", f"{label}: {n} runs"))
        chart.labels.append((round(left + (j + 0.5) * bar_w, 1), height - 14, label, "middle"))
    chart.labels.append((left - 4, top + 4, str(peak), "end"))
    chart.lines.append((left, top + plot_h, width - 4, top + plot_h))
    return chart


def _ms(ms: float) -> str:
    return f"{ms:g}ms" if ms < 1000 else format_duration(ms / 1000).replace(".0s", "s")


def _bucket_label(i: int) -> str:
    if i >= len(DURATION_BOUNDS_MS):
        return f"≥{_ms(DURATION_BOUNDS_MS[-1])}"
    return f"<{_ms(DURATION_BOUNDS_MS[i])}"


def rate_bars(jobs: Sequence[JobStats], *, width: float = 260, row: float = 20) -> Chart:
    """The flakiest jobs: one horizontal bar per job, its share of runs that needed a retry."""
    chart = Chart(width, row * max(len(jobs), 1))
    for k, job in enumerate(jobs):
        share = job.retry_rate or 0.0
        chart.bars.append(Bar(0, k * row + 3, round(max(share * width, 2), 1), row - 6, "retried",
                              f"{job.job_id}: {job.retried} of {job.runs} runs retried"))
    return chart
