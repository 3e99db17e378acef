"""What a sweep's report shows of each run (``RunFacts``, gathered by ``launcher.cli.sweeps``), and the
runs ranked by one metric of the trainer's: the best (lowest) value each run logged. Nothing here
imports plotly: ``launcher status SWEEP`` ranks nothing but reads the best val_loss the same way."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEFAULT_METRIC = "val_loss"


@dataclass(frozen=True)
class RunFacts:
    """One run of a sweep. ``metrics``: the trainer's records from its run dir (None before its job
    exists, or when not readable here, with ``metrics_note`` saying why)."""

    index: int
    values: dict[str, str]  # key -> value, as typed
    state: str
    step: int | None  # the furthest step its ranks reached (the last attempt's)
    goodput: float | None  # training seconds over wall seconds, 0..1
    job_id: str
    error: str | None  # why it failed to submit, or its job's message
    metrics: list[dict[str, Any]] | None
    metrics_note: str


@dataclass(frozen=True)
class SweepFacts:
    """Everything a sweep's report shows. ``states``: its runs by state, in words; ``made_at``: epoch s."""

    sweep_id: str
    scheduler: str
    states: str
    runs: list[RunFacts]
    made_at: float


@dataclass(frozen=True)
class Best:
    """A run's best value of a metric and the step it was logged at."""

    value: float
    step: int


@dataclass(frozen=True)
class Ranked:
    """A run's place: ``rank`` 1 is the best; None for a run that logged no value of the metric."""

    rank: int | None
    run: RunFacts
    best: Best | None


def best(metrics: list[dict[str, Any]], name: str) -> Best | None:
    """The lowest value of ``name`` in ``metrics`` and its step (the earliest, on a tie). A NaN or an
    infinity (a run that diverged) is no value; None when no record has one."""
    found: Best | None = None
    for record in metrics:
        value = record.get(name)
        # bool is an int to Python, and no metric; NaN compares False with everything, and would stick.
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        if found is None or value < found.value:
            found = Best(float(value), record["step"])
    return found


def ranking(runs: list[RunFacts], metric: str) -> list[Ranked]:
    """``runs`` best first by ``metric`` (lower is better); those with no value last, unranked. Runs
    with the same best value keep the sweep's order, and each its own rank."""
    scored = [(run, best(run.metrics or [], metric)) for run in runs]
    with_value = sorted(
        ((run, b) for run, b in scored if b is not None), key=lambda rb: (rb[1].value, rb[0].index)
    )
    without = [run for run, b in scored if b is None]
    return [Ranked(k, run, b) for k, (run, b) in enumerate(with_value, start=1)] + [
        Ranked(None, run, None) for run in without
    ]
