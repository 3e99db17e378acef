"""A sweep's record: ``JOBS_ROOT/<sweep id>/sweep.json`` (its runs, their values and how each is
submitted) beside one job record per run, ``JOBS_ROOT/<sweep id>/<run's job id>/``: the job record every
command already reads, unchanged. Only the sweep's driver (``launcher.sweep.drive``) writes
``sweep.json`` after ``submit`` made it; ``cancel`` leaves a mark (``CANCEL``) that the driver obeys.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
from pydantic import BaseModel, ConfigDict

from gptlaunch.contract import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from gptlaunch.files import atomic_write_text
from launcher.job.record import JobError, JobNotFound, JobRecord, JobState, JobStatus, ProcessRef
from launcher.schedulers import get_scheduler
from launcher.schedulers.base import Scheduler
from launcher.supervisor import procs

SWEEP_FILE = "sweep.json"
CANCEL = "cancel"  # in the sweep's directory: no run starts any more
DRIVER = "driver.json"  # the driver's process (a ProcessRef: a reused pid is not it)
QUEUED, NOT_STARTED, SUBMIT_FAILED, UNREADABLE = "queued", "not started", "submit failed", "unreadable"
# Worst first: ``wait SWEEP`` exits with the code of the worst run.
_SEVERITY = [JobState.FAILED, JobState.LOST, JobState.UNKNOWN, JobState.CANCELLED, JobState.CHECKPOINTED]


class SweepRun(BaseModel):
    """One run of a sweep: its values, its job, and how its ``launcher submit`` went."""

    model_config = ConfigDict(extra="forbid")
    index: int
    values: dict[str, str]
    job_id: str
    argv: list[str]  # ``launcher`` arguments that submit it (detached, into the sweep's directory)
    submitted_at: float | None = None  # epoch seconds; None: still queued
    submit_error: str | None = None  # the last line of a submit that failed before its job existed


class Sweep(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sweep_id: str
    created_at: float
    scheduler: str
    max_parallel: int | None  # runs at once (None: all)
    runs: list[SweepRun]


class SweepRecord:
    """The directory of one sweep."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    @classmethod
    def create(cls, directory: Path, sweep: Sweep) -> SweepRecord:
        """Write a new sweep's record. Raises FileExistsError when ``directory`` is not empty."""
        directory.mkdir(parents=True, exist_ok=True)
        if any(directory.iterdir()):
            raise FileExistsError(f"{directory} is not empty: pass a new --job-dir or none")
        record = cls(directory)
        record.save(sweep)
        return record

    @classmethod
    def find(cls, ref: str, jobs_root: Path) -> SweepRecord | None:
        """The sweep ``ref`` (an id under ``jobs_root``, or a directory); None when it is not one."""
        for path in (jobs_root / ref, Path(ref)):
            if (path / SWEEP_FILE).is_file():
                return cls(path)
        return None

    def load(self) -> Sweep:
        """The sweep. Raises JobError when its record cannot be read (exit 2, naming it)."""
        try:
            return Sweep.model_validate_json((self.dir / SWEEP_FILE).read_text())
        except (OSError, ValueError) as e:
            raise JobError(f"cannot read the sweep's record {self.dir / SWEEP_FILE}: {e}") from None

    def save(self, sweep: Sweep) -> None:
        atomic_write_text(self.dir / SWEEP_FILE, sweep.model_dump_json(indent=2) + "\n")

    def job(self, run: SweepRun) -> JobRecord | None:
        """The run's job record; None before its submit wrote one."""
        try:
            return JobRecord.open(run.job_id, self.dir)
        except (JobNotFound, JobError):
            return None

    def request_cancel(self) -> None:
        (self.dir / CANCEL).touch()

    def cancel_requested(self) -> bool:
        return (self.dir / CANCEL).exists()

    def driver_is(self, pid: int) -> None:
        """Record process ``pid`` as the sweep's driver."""
        atomic_write_text(self.dir / DRIVER, procs.process_ref(pid).model_dump_json())

    def driver_alive(self) -> bool:
        """Whether the sweep's driver may still run (``procs.alive``); False before one is recorded."""
        try:
            return procs.alive(ProcessRef.model_validate_json((self.dir / DRIVER).read_text()))
        except (OSError, ValueError, psutil.Error):
            return False


def run_status(record: SweepRecord, run: SweepRun) -> tuple[str, JobStatus | None]:
    """The run's state in words and its job's status (None before it has a job)."""
    if run.submit_error is not None:
        return SUBMIT_FAILED, None
    job = record.job(run)
    if job is None:  # it starts once a run ends, unless cancelled or nothing drives the sweep
        return (QUEUED if record.driver_alive() and not record.cancel_requested() else NOT_STARTED), None
    try:
        status = scheduler_of(job).state(job)
    except (OSError, ValueError, KeyError, JobError):  # one bad run record: said, the others shown
        return UNREADABLE, None
    return str(status.state), status


_schedulers = functools.cache(get_scheduler)  # one per kind, for the whole command


def scheduler_of(job: JobRecord) -> Scheduler[Any]:
    """The scheduler ``job`` was submitted to, one per kind for the whole command: SLURM's asks sacct
    at most every few seconds per job through it, however often a sweep's runs are read. Raises
    JobError when this launcher lacks it."""
    name = job.plan().scheduler
    try:
        return _schedulers(name)
    except KeyError:
        raise JobError(f"{job.dir} was submitted to scheduler {name!r}, which this launcher lacks") from None


def counts(states: list[str]) -> str:
    """``2 succeeded, 1 running, 1 queued``: the runs by state, most first."""
    return ", ".join(f"{n} {state}" for state, n in Counter(states).most_common())


def worst_exit_code(statuses: list[tuple[str, JobStatus | None]]) -> int:
    """The exit code of the sweep's worst run: a failure's before a cancel's before a checkpoint's;
    a run whose submit failed, or that never started, counts as failed or cancelled."""
    if any(state in (SUBMIT_FAILED, UNREADABLE) for state, _ in statuses):
        return EXIT_FAILED
    ended = [s for _, s in statuses if s is not None]
    for state in _SEVERITY:
        if found := [s for s in ended if s.state == state]:
            return found[0].job_exit_code
    return EXIT_INTERRUPTED if any(state == NOT_STARTED for state, _ in statuses) else EXIT_OK


def is_done(statuses: list[tuple[str, JobStatus | None]]) -> bool:
    """Whether nothing of the sweep runs or will: every run ended or never starts."""
    waiting = any(state == QUEUED for state, _ in statuses)
    return not waiting and all(s is None or s.state.is_terminal for _, s in statuses)
