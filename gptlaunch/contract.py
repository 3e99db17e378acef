"""The contract between the trainer and whatever launches it (our launcher, bare torchrun, a scheduler).

Exit codes, the stop-marker file, the ``GPTLAUNCH_*`` environment variables and the progress
heartbeat's format. The trainer reaches it only through ``gptlaunch.runtime``.
It imports no torch (nor numpy): the launcher's read-only commands (``status``, ``cancel``, ...) use it
and must answer in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from gptlaunch.files import atomic_write_text

# Exit codes of `trainer` and `launcher` (the launcher adds EXIT_REFUSED and EXIT_INTERRUPTED).
EXIT_OK = 0
EXIT_FAILED = 1  # training (or the job) failed
EXIT_USAGE = 2  # invalid input; the message names the flag or field and the fix
# Nodes refused before training: their versions differ where they must match (version parity), a node
# lacks GPUs, or the health check named a node. No rank of the job was started.
EXIT_REFUSED = 3
EXIT_CHECKPOINTED = 75  # EX_TEMPFAIL: stopped by a signal after saving a checkpoint; requeue to resume
EXIT_INTERRUPTED = 130  # stopped on request before any checkpoint could be saved (128 + SIGINT)

# Environment variables.
JOB_ID_ENV = "GPTLAUNCH_JOB_ID"  # set by the launcher on every process of a job: finds orphans
# The run's id for a tracker (W&B, MLflow): the same across its attempts, retries and requeues.
RUN_ID_ENV = "GPTLAUNCH_RUN_ID"
SWEEP_ID_ENV = "GPTLAUNCH_SWEEP_ID"  # a sweep's runs: the sweep's id (W&B's WANDB_RUN_GROUP too)
JOBS_ROOT_ENV = "GPTLAUNCH_JOBS_ROOT"  # where the launcher keeps job records (default ./jobs)
NODE_RANK_ENV = "GPTLAUNCH_NODE_RANK"  # a node's index where no scheduler says it (SLURM_NODEID does)
FIRST_HOST_ENV = "GPTLAUNCH_FIRST_HOST"  # the job's first host where no scheduler says it
RUN_DIR_ENV = "GPTLAUNCH_RUN_DIR"  # the job's run dir: where a program's checkpoints go
RESUME_ARGS_ENV = "GPTLAUNCH_RESUME_ARGS"  # JSON list: a program's arguments from the second attempt on
ATTEMPT_ENV = "GPTLAUNCH_ATTEMPT"  # the job's attempt that started this process: 1, 2, ... (retries)

RETRIES_ENV = "GPTLAUNCH_RETRIES"  # the job's --retries (set when > 0): a later attempt may resume

# In-memory snapshots of a job's training state (tmpfs: host memory), one directory per user (mode
# 0700: another user's snapshots are neither read nor in the way), then per job (the launcher's job id,
# or torchrun's rendezvous id), then per run dir: the launcher removes a job's when it ends for good,
# without knowing its run dirs.
SNAPSHOT_ROOT = Path(f"/dev/shm/gptlaunch-{os.getuid()}")


def job_snapshots(job_id: str) -> Path:
    """This host's directory of the in-memory snapshots of job ``job_id`` (any run dir)."""
    return SNAPSHOT_ROOT / "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)


# Written by rank 0 after the checkpoint of a stop signal, in the run dir: tells a launcher or
# scheduler that the run stopped cleanly and can be resumed (torchrun reports the ranks' exit code 75
# as a plain failure).
STOP_MARKER = "stopped.json"


@dataclass(frozen=True)
class StopMarker:
    """The run stopped on a signal after saving a checkpoint (``<run dir>/stopped.json``): the step,
    the checkpoint's file name, when (epoch seconds) and the signal rank 0 received (None if only other
    ranks got one): SIGUSR2 is SLURM's warning before a time limit or preemption (the job is requeued),
    SIGTERM a request to stop."""

    step: int
    checkpoint: str
    time: float
    signal: str | None = None


def write_stop_marker(run_dir: Path, step: int, checkpoint_file: Path, signal: str | None = None) -> None:
    """Record, atomically, that the run stopped on ``signal`` after saving ``checkpoint_file``."""
    marker = StopMarker(step=step, checkpoint=checkpoint_file.name, time=time.time(), signal=signal)
    atomic_write_text(run_dir / STOP_MARKER, json.dumps(dataclasses.asdict(marker)))


def read_stop_marker(run_dir: Path, since: float) -> StopMarker | None:
    """The stop marker of a run that stopped on a signal at or after ``since`` (epoch seconds); None
    when there is none, or one that this version cannot read."""
    try:
        marker = StopMarker(**json.loads((run_dir / STOP_MARKER).read_text()))
    except (OSError, ValueError, TypeError):  # TypeError: not an object, or other fields
        return None
    return marker if marker.time >= since else None


def clear_stop_marker(run_dir: Path) -> None:
    (run_dir / STOP_MARKER).unlink(missing_ok=True)


# Progress heartbeats: each rank replaces ``<dir>/rank-<rank>.json`` (dir from HEARTBEAT_DIR_ENV, one
# per node, set by the launcher) with a ``Beat`` when its phase changes and at most every
# BEAT_INTERVAL_S while it advances; the watcher on its node reads them. A file, not the rendezvous
# store: reading it needs no connection, works while the store's host is the one that hangs, and
# costs the ranks no network round trip.
HEARTBEAT_DIR_ENV = "GPTLAUNCH_HEARTBEAT_DIR"
BEAT_INTERVAL_S = 0.5
PHASES = ("startup", "step", "eval", "checkpoint")  # startup: until the first step ends (compile too)


@dataclass(frozen=True)
class Beat:
    """One rank's progress: ``step`` optimizer steps done, in ``phase`` since ``phase_since`` (epoch
    seconds), last advanced at ``time`` (epoch seconds); ``slowest_step_s``, the slowest of its recent
    steps (seconds; 0 before the first); ``compute_s``, its mean forward seconds per recent step
    (``gptlaunch.compute``: the straggler check's measure; None before one is timed); ``debug_socket``,
    where torch's worker server answers for it (``gptlaunch.flight_recorder``); ``start_step``, the step
    the process resumed at, and ``phase_s``, the seconds it has spent in each phase (for goodput)."""

    rank: int
    local_rank: int
    pid: int
    step: int
    phase: str
    phase_since: float
    time: float
    slowest_step_s: float = 0.0
    compute_s: float | None = None  # mean forward seconds per recent step (``gptlaunch.compute``)
    debug_socket: str | None = None  # its flight recorder's server (``gptlaunch.flight_recorder``)
    start_step: int = 0  # the step this process started (resumed) at
    phase_s: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds in each phase, to ``time``
    tokens: int | None = None  # tokens this rank has processed, when its program says (``runtime.beat``)
    warning: str | None = None  # what its program wants seen in ``launcher status`` (``runtime.warn``)
    # Its start-up in the parts its program named (``runtime.starting``), in order, to ``time``; the
    # last is the current one while ``phase`` is "startup". ``expect_s``: the current part's expected
    # seconds, where its program knows them (a compile timed before).
    startup_s: dict[str, float] = dataclasses.field(default_factory=dict)
    expect_s: float | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def write_beat(directory: Path, beat: Beat) -> None:
    """Replace ``beat``'s file in ``directory`` (no fsync: a beat need not survive a crash, and a
    rename is atomic for its reader). Raises OSError."""
    tmp = directory / f".rank-{beat.rank}.json.tmp"
    tmp.write_text(beat.to_json())
    os.replace(tmp, directory / f"rank-{beat.rank}.json")


def clear_beats(directory: Path) -> None:
    """Remove the beats in ``directory`` (an earlier run's: a requeue or a retry), if any."""
    for path in directory.glob("rank-*.json"):
        path.unlink(missing_ok=True)


def read_beats(directory: Path) -> list[Beat]:
    """Every rank's latest beat in ``directory``, by rank; a file that is unreadable or of another
    format is skipped (empty when the directory is missing)."""
    beats = []
    known = {f.name for f in dataclasses.fields(Beat)}
    for path in sorted(directory.glob("rank-*.json")):
        try:  # fields this version does not know (another version's) are left out
            beats.append(Beat(**{k: v for k, v in json.loads(path.read_text()).items() if k in known}))
        except (OSError, ValueError, TypeError, AttributeError):  # AttributeError: not an object
            continue
    return sorted(beats, key=lambda b: b.rank)
