"""A sweep's runs at a glance: ``launcher list``'s line per sweep, ``status SWEEP``'s table, and the
facts its report page draws (``RunFacts``), from each run's job record and run dir (asking no host);
the runs ranked by one metric of the trainer's: the best (lowest) value each run logged. Nothing here
imports plotly: ``status SWEEP`` ranks nothing but reads the best val_loss the same way."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.job.console import say
from launcher.job.goodput import job_goodput
from launcher.job.progress import last_step, recorded_beats
from launcher.job.record import JobError
from launcher.report.facts import job_metrics
from launcher.sweep.points import describe
from launcher.sweep.record import SWEEP_FILE, SweepRecord, counts, run_status

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


def best_val_loss(run: RunFacts) -> float | None:
    """The lowest DEFAULT_METRIC ``run`` logged (``best``): ``status SWEEP``'s column, in text or JSON."""
    lowest = best(run.metrics or [], DEFAULT_METRIC)
    return None if lowest is None else lowest.value


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


def list_rows(jobs_root: Path) -> list[str]:
    """One line per sweep under ``jobs_root``: its id and its runs by state."""
    found = []
    for path in jobs_root.glob(f"*/{SWEEP_FILE}"):
        try:
            found.append((SweepRecord(path.parent), SweepRecord(path.parent).load()))
        except JobError as e:  # said on stderr, and the other sweeps listed
            say(f"launcher: unreadable sweep record {path.parent.name}: {e}")
    rows = []
    for record, sweep in sorted(found, key=lambda found: found[1].created_at):
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(sweep.created_at))
        states = counts([run_status(record, run)[0] for run in sweep.runs])
        rows.append(f"{sweep.sweep_id:40} {'sweep':13} {len(sweep.runs):>5} runs  {created:20} {states}")
    return rows


def run_facts(record: SweepRecord, now: float) -> list[RunFacts]:
    """Each run of the sweep: its state, the furthest step, goodput and the trainer's metrics, from
    its job record and run dir (asking no host), ``now`` in epoch seconds."""
    found = []
    for run in record.load().runs:
        state, status = run_status(record, run)
        job, step, goodput = record.job(run), None, None
        metrics, note = None, ""
        if job is not None and status is not None:
            beats = recorded_beats(job.plan(), job.dir)
            step = last_step(beats)
            ratio = job_goodput(job.dir, status, beats, now)
            goodput = ratio.ratio if ratio is not None else None
            metrics, note = job_metrics(job)
        error = run.submit_error or (status.message if status is not None else None) or None
        found.append(RunFacts(run.index, run.values, state, step, goodput, run.job_id, error, metrics, note))
    return found


def print_table(record: SweepRecord) -> None:
    """``status SWEEP``: the sweep's runs by state, then one line per run."""
    found = run_facts(record, time.time())
    width = max([len(describe(r.values)) for r in found] + [6])
    print(f"sweep {record.load().sweep_id}: {counts([r.state for r in found])}")
    print(
        f"{'RUN':>3}  {'VALUES':{width}}  {'STATE':13} {'STEP':>6} {'BEST VAL LOSS':>13} {'GOODPUT':>7}  JOB"
    )
    for r in found:
        step = "-" if r.step is None else f"{r.step:,}"
        low = "-" if (lowest := best_val_loss(r)) is None else f"{lowest:.4f}"
        goodput = "-" if r.goodput is None else f"{r.goodput:.0%}"
        values = describe(r.values)
        print(f"{r.index:>3}  {values:{width}}  {r.state:13} {step:>6} {low:>13} {goodput:>7}  {r.job_id}")
