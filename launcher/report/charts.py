"""The report's charts, as plotly figures: loss, each rank's own throughput, the attempts' timeline
and where the wall time went. Each returns None when the job has no data for it (the page says so in
words instead of drawing an empty chart)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative

from launcher.job import startup
from launcher.job.goodput import Goodput
from launcher.report.facts import Mark, Span

COLORS = {"failed": "#d62728", "running": "#1f77b4", "succeeded": "#2ca02c"}
OTHER_COLOR = "#7f7f7f"
RUN_COLORS = qualitative.Dark24  # one per run of a sweep, in turn
# Goodput's parts, in the order of the bar: (field, label, color).
PARTS = (
    ("training_s", "training", "#2ca02c"),
    ("startup_s", "start-up", "#9467bd"),
    ("lost_s", "lost to failures", "#d62728"),
    ("checkpoint_s", "checkpoint stalls", "#ff7f0e"),
    ("eval_s", "evaluation", "#17becf"),
    ("other_s", "other", OTHER_COLOR),
)


def _layout(fig: go.Figure, title: str, x: str, y: str, height: int = 360) -> go.Figure:
    """Titles, and the legend in a row under the chart (``height``: pixels, the legend's included)."""
    fig.update_layout(
        title=title, xaxis_title=x, yaxis_title=y, height=height, template="plotly_white",
        margin={"l": 80, "r": 20, "t": 50, "b": 50},
        legend={"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom"},
    )  # fmt: skip
    return fig


def _scatter(points: list[tuple[Any, float]], **kw: Any) -> go.Scatter:
    """A line through ``points``: (x, y) each."""
    return go.Scatter(x=[x for x, _ in points], y=[y for _, y in points], **kw)


def loss(metrics: list[dict[str, Any]], spans: list[Span]) -> go.Figure | None:
    """Training and validation loss (nats) by step, with a line where each failed attempt stopped."""
    train, val = training_loss(metrics), validation_loss(metrics)
    if not train and not val:
        return None
    fig = go.Figure()
    if train:
        fig.add_trace(_scatter(train, name="training loss"))
    if val:
        fig.add_trace(_scatter(val, name="validation loss", mode="lines+markers"))
    for span in spans:
        if span.outcome == "failed" and span.step is not None:
            fig.add_vline(x=span.step, line_dash="dot", line_color=COLORS["failed"])
            fig.add_annotation(x=span.step, y=1, yref="paper", text=f"attempt {span.number} failed",
                               showarrow=False, xanchor="left", font={"color": COLORS["failed"]})  # fmt: skip
    return _layout(fig, "Loss", "step", "loss (nats)")


def training_loss(metrics: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, loss in nats) of the trainer's log records: those with ``tokens_per_s`` (an evaluation's
    record carries the loss of its step too, and would draw it twice)."""
    return [(m["step"], m["loss"]) for m in metrics if "tokens_per_s" in m and "loss" in m]


def validation_loss(metrics: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, validation loss in nats) of the trainer's evaluations."""
    return [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]


def overlay(
    title: str, y: str, lines: list[tuple[str, list[tuple[int, float]]]], markers: bool = False
) -> go.Figure | None:
    """Runs side by side: one line per (name, (step, value) points) on one step axis. A run keeps its
    color (its place in ``lines``) on every chart of a page, also where another run has no point;
    None when no run has one."""
    if not any(points for _, points in lines):
        return None
    fig = go.Figure()
    for k, (name, points) in enumerate(lines):
        if points:
            fig.add_trace(_scatter(points, name=name, mode="lines+markers" if markers else "lines",
                                   line={"color": RUN_COLORS[k % len(RUN_COLORS)]}))  # fmt: skip
    return _layout(fig, title, "step", y, height=360 + 20 * (len(lines) // 4))  # the legend's rows


def rank_throughput(metrics: list[dict[str, Any]]) -> go.Figure | None:
    """Each rank's own throughput by step (``rank_tokens_per_s``: its tokens per step over its forward
    seconds per step, the straggler check's numbers), one line per rank: a straggler's runs below the
    others. None when the records carry none."""
    rows = [(m["step"], m["rank_tokens_per_s"]) for m in metrics if m.get("rank_tokens_per_s")]
    if not rows:
        return None
    ranks = range(max(len(r) for _, r in rows))
    lines = {rank: [(s, r[rank]) for s, r in rows if len(r) > rank] for rank in ranks}
    return _per_rank(lines, "Each rank's own throughput (forward passes)", "step", "tokens/s")


def rank_compute(series: dict[int, list[tuple[float, float]]]) -> go.Figure | None:
    """Each rank's compute seconds per step over wall-clock time, as the launcher's straggler check
    measured it from the ranks' beats (any program: ``launcher.job.scalars``), one line per rank: a
    straggler's runs above the others. None when there is no point."""
    if not any(series.values()):
        return None
    lines = {rank: [(_utc(t), v) for t, v in points] for rank, points in series.items()}
    return _per_rank(lines, "Each rank's compute per step (forward passes)", "time (UTC)", "seconds")


def _per_rank(lines: dict[int, list[tuple[Any, float]]], title: str, x: str, y: str) -> go.Figure:
    """One line per rank (``lines``: its (x, y) points by rank), in rank order."""
    fig = go.Figure()
    for rank, points in sorted(lines.items()):
        fig.add_trace(_scatter(points, name=f"rank {rank}"))
    return _layout(fig, title, x, y)


MARKS = {"checkpoint": ("diamond", "#ff7f0e"), "hang": ("x", "#9467bd")}  # kind: (symbol, color)


def timeline(spans: list[Span], marks: list[Mark], now: float) -> go.Figure | None:
    """The attempts on a wall-clock axis, one bar each, colored by how it ended, with its cause; the
    checkpoints and hangs as marks on the attempt they fell in."""
    if not spans:
        return None
    fig = go.Figure()
    for span in spans:
        end = span.ended_at if span.ended_at is not None else now
        fig.add_trace(
            go.Bar(
                x=[(end - span.started_at) * 1000],  # a date axis counts milliseconds
                y=[f"attempt {span.number}"],
                base=[_utc(span.started_at)],
                orientation="h",
                name=f"attempt {span.number}: {span.outcome}",
                marker_color=COLORS.get(span.outcome, OTHER_COLOR),
                hovertext=describe(span),
            )
        )
    for kind, (symbol, color) in MARKS.items():
        placed = [(m, n) for m in marks if m.kind == kind and (n := _attempt_at(spans, m.time, now))]
        if placed:
            fig.add_trace(go.Scatter(
                x=[_utc(m.time) for m, _ in placed], y=[f"attempt {n}" for _, n in placed], mode="markers",
                name=f"{kind}s", marker={"symbol": symbol, "color": color, "size": 11},
                hovertext=[m.text for m, _ in placed], hoverinfo="text",
            ))  # fmt: skip
    fig.update_xaxes(type="date")
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, "Attempts", "time (UTC)", "", height=200 + 40 * len(spans))


def _attempt_at(spans: list[Span], time: float, now: float) -> int | None:
    """The attempt that ran at ``time`` (epoch seconds), None outside every attempt."""
    for span in spans:
        if span.started_at <= time <= (span.ended_at if span.ended_at is not None else now):
            return span.number
    return None


def describe(span: Span) -> str:
    """``attempt 1: failed at step 16: CAUSE (gl-h2 replaced by gl-h3); first step 13.4 s after the
    start: launch 8.1 s, ...``."""
    at = f" at step {span.step:,}" if span.step is not None else ""
    text = f"attempt {span.number}: {span.outcome}{at}" + (f": {span.cause}" if span.cause else "")
    text += f" ({span.moved})" if span.moved else ""
    return text + (f"; {startup.first_step(span.startup)}" if span.startup else "")


def goodput_bar(goodput: Goodput) -> go.Figure:
    """Where the wall time went, as one stacked bar of seconds."""
    fig = go.Figure()
    for field, label, color in PARTS:
        seconds = float(getattr(goodput, field))
        share = seconds / goodput.wall_s if goodput.wall_s > 0 else 0.0
        fig.add_trace(
            go.Bar(x=[seconds], y=["wall time"], orientation="h", name=f"{label} {share:.1%}",
                   marker_color=color, hovertext=f"{label}: {seconds:.0f} s ({share:.1%})")
        )  # fmt: skip
    fig.update_layout(barmode="stack")
    return _layout(fig, f"Goodput {goodput.ratio:.1%}", "seconds", "", height=260)


def _utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
