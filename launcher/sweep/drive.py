"""A sweep's driver: it starts the sweep's runs in order, at most ``max_parallel`` at once, each as one
``launcher submit --detach`` into the sweep's directory (a whole job: a failed run does not stop the
others), the next as a run ends, none once the sweep is cancelled. An attached ``submit --sweep`` drives
the sweep itself; ``--detach`` starts this module's ``main`` as a process of its own (``python -m
launcher.sweep.drive SWEEP_DIR``), which outlives the shell."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from launcher.job.console import say
from launcher.sweep.points import describe
from launcher.sweep.record import SWEEP_FILE, Sweep, SweepRecord, SweepRun, run_status, scheduler_of

POLL_S = 1.0  # how often the runs' states are read (a file read each: cheap)


def drive(record: SweepRecord) -> None:
    """Run the sweep of ``record`` to its end (every run ended or, once cancelled, never started),
    saying each run's start and end (stderr). A submitted run whose job record cannot be
    read (removed with the sweep's directory) is not waited for: the driver never outlives its sweep."""
    sweep = record.load()
    told: dict[int, str] = {}
    while (record.dir / SWEEP_FILE).is_file():
        active = []
        for run in (r for r in sweep.runs if r.submitted_at is not None and r.submit_error is None):
            state, status = run_status(record, run)  # a submitted run has its record: submit returned
            if status is not None and not status.state.is_terminal:
                active.append(run)
            elif told.get(run.index) != state:
                told[run.index] = state
                say(f"launcher: sweep {sweep.sweep_id}: run {run.index} ({describe(run.values)}) {state}")
        if record.cancel_requested():
            cancel_active(record, active)
            return
        queued = [r for r in sweep.runs if r.submitted_at is None]
        while queued and (sweep.max_parallel is None or len(active) < sweep.max_parallel):
            if record.cancel_requested():  # asked while the one before was being submitted
                break
            run = queued.pop(0)
            _submit(record, sweep, run)
            if run.submit_error is None:
                active.append(run)
        if not queued and not active:
            return
        time.sleep(POLL_S)


def _submit(record: SweepRecord, sweep: Sweep, run: SweepRun) -> None:
    """Submit ``run`` (``launcher submit --detach``, its output in ``<job id>.submit.log``) and record
    that it was, or why it could not be."""
    log = record.dir / f"{run.job_id}.submit.log"
    with log.open("w") as out:
        ended = subprocess.run(
            [sys.executable, "-m", "launcher.cli.main", *run.argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    run.submitted_at = time.time()
    if ended.returncode != 0 and record.job(run) is None:  # refused before its job existed
        lines = log.read_text().strip().splitlines()
        run.submit_error = lines[-1] if lines else f"launcher submit exited {ended.returncode}"
    said = f"not submitted: {run.submit_error}" if run.submit_error else f"started: {run.job_id}"
    say(f"launcher: sweep {sweep.sweep_id}: run {run.index} ({describe(run.values)}) {said}")
    record.save(sweep)


def cancel_active(record: SweepRecord, runs: list[SweepRun]) -> None:
    """Cancel the sweep's ``runs`` that have a job (each one's ranks checkpoint, as `cancel JOB`):
    a run submitted just now has one before the sweep's record says so."""
    for run in runs:
        job = record.job(run)
        if job is not None:
            scheduler_of(job).cancel(job)


def main(argv: list[str]) -> int:
    """``python -m launcher.sweep.drive SWEEP_DIR``: drive that sweep to its end."""
    drive(SweepRecord(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
