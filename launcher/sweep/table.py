"""A sweep's runs at a glance: ``launcher list``'s line per sweep, ``status SWEEP``'s table, and the
facts its report page draws, from each run's job record and run dir (asking no host)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from launcher.job.console import say
from launcher.job.goodput import job_goodput
from launcher.job.progress import last_step, recorded_beats
from launcher.job.record import JobError
from launcher.report import sweep_facts
from launcher.report.facts import job_metrics
from launcher.report.sweep_facts import DEFAULT_METRIC, RunFacts
from launcher.sweep.points import describe
from launcher.sweep.record import SWEEP_FILE, SweepRecord, counts, run_status


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


@dataclass(frozen=True)
class Row:
    """One run of a sweep as ``status`` shows it."""

    run: int
    values: dict[str, str]
    state: str
    step: int | None  # the furthest step its ranks reached (the last attempt's)
    best_val_loss: float | None  # the lowest in its run dir's metrics.jsonl, where readable here
    goodput: float | None
    job_id: str
    error: str | None  # why it failed to submit, or its job's message


def rows(record: SweepRecord) -> list[Row]:
    """The sweep's runs as ``status`` shows them."""
    found = []
    for f in run_facts(record, time.time()):
        best = sweep_facts.best(f.metrics or [], DEFAULT_METRIC)
        best_val_loss = best.value if best is not None else None
        found.append(Row(f.index, f.values, f.state, f.step, best_val_loss, f.goodput, f.job_id, f.error))
    return found


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
    found = rows(record)
    width = max([len(describe(r.values)) for r in found] + [6])
    print(f"sweep {record.load().sweep_id}: {counts([r.state for r in found])}")
    print(
        f"{'RUN':>3}  {'VALUES':{width}}  {'STATE':13} {'STEP':>6} {'BEST VAL LOSS':>13} {'GOODPUT':>7}  JOB"
    )
    for r in found:
        step = "-" if r.step is None else f"{r.step:,}"
        best = "-" if r.best_val_loss is None else f"{r.best_val_loss:.4f}"
        goodput = "-" if r.goodput is None else f"{r.goodput:.0%}"
        values = describe(r.values)
        print(f"{r.run:>3}  {values:{width}}  {r.state:13} {step:>6} {best:>13} {goodput:>7}  {r.job_id}")
