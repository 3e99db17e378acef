"""Goodput: the share of a job's wall time that went into training steps that count, and where the
rest went, from rank 0's last heartbeat (``gptlaunch.contract.Beat``: the seconds its process spent in
each phase, the step it resumed at) of each attempt; a retried job keeps every attempt's last beats in
``JOB/attempts/<k>/heartbeat/``. Its parts are defined in ``docs/keeping-alive.md`` (Goodput).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from gptlaunch.contract import Beat, read_beats
from launcher.job.record import JobStatus
from launcher.job.retry import ATTEMPTS_DIR

STARTUP, STEP, EVAL, CHECKPOINT = "startup", "step", "eval", "checkpoint"


class Goodput(BaseModel):
    """Where a job's wall time went, in seconds."""

    model_config = ConfigDict(frozen=True)
    wall_s: float
    training_s: float
    startup_s: float
    lost_s: float
    checkpoint_s: float
    eval_s: float
    other_s: float
    failures: int
    steps_redone: list[int] = []  # for each failure, the steps the next attempt did again

    @property
    def ratio(self) -> float:
        return self.training_s / self.wall_s if self.wall_s > 0 else 0.0

    def describe(self) -> str:
        """E.g. ``goodput 91%: 3 h 10 min training of 3 h 29 min; start-up 2 min; lost 12 min to 2
        failures (40 + 12 steps redone); checkpoint stalls 3 min; evaluation 1 min; other 1 min``."""
        parts = [
            f"goodput {self.ratio:.0%}: {_span(self.training_s)} training of {_span(self.wall_s)}",
            f"start-up {_span(self.startup_s)}",
        ]
        if self.failures:
            lost = f"lost {_span(self.lost_s)} to {self.failures} failure{'s' * (self.failures > 1)}"
            if self.steps_redone:
                lost += f" ({' + '.join(map(str, self.steps_redone))} steps redone)"
            parts.append(lost)
        parts += [f"checkpoint stalls {_span(self.checkpoint_s)}", f"evaluation {_span(self.eval_s)}"]
        parts.append(f"other {_span(self.other_s)}")
        return "; ".join(parts)


def _span(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 600:  # minutes and seconds while the seconds still matter
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def first_step_at(beat: Beat) -> float:
    """When ``beat``'s process finished its start-up: its start (its time less all its phases) plus
    its start-up."""
    return beat.time - sum(beat.phase_s.values()) + beat.phase_s.get(STARTUP, 0.0)


def _resumed_at(later: list[Beat | None]) -> int | None:
    """The step the first of the ``later`` attempts that got past its start-up resumed at (None: none
    did yet). One still starting may not know it: its beats say 0 until it has loaded its checkpoint."""
    return next((b.start_step for b in later if b is not None and b.phase != STARTUP), None)


def account(attempts: list[Beat | None], wall_s: float) -> Goodput:
    """The goodput of a job whose attempts' last beats (rank 0's, oldest first; None where none was
    kept) are ``attempts``, over ``wall_s`` seconds of wall time."""
    training = startup = lost = checkpoint = evaluation = 0.0
    steps_redone = []
    for k, beat in enumerate(attempts):
        if beat is None:
            continue
        nxt = attempts[k + 1] if k + 1 < len(attempts) else None
        steps = beat.step - beat.start_step
        step_s = beat.phase_s.get(STEP, 0.0)
        resumed = _resumed_at(attempts[k + 1 :])
        redone = max(0, beat.step - resumed) if nxt is not None and resumed is not None else 0
        redone_s = step_s * min(redone, steps) / steps if steps > 0 else 0.0
        training += step_s - redone_s
        checkpoint += beat.phase_s.get(CHECKPOINT, 0.0)
        evaluation += beat.phase_s.get(EVAL, 0.0)
        if k == 0:
            startup += beat.phase_s.get(STARTUP, 0.0)
        if nxt is not None:  # this attempt failed: from its last beat to the next one's first step
            lost += redone_s + max(0.0, first_step_at(nxt) - beat.time)
            steps_redone.append(redone)
    counted = training + startup + lost + checkpoint + evaluation
    return Goodput(
        wall_s=wall_s,
        training_s=training,
        startup_s=startup,
        lost_s=lost,
        checkpoint_s=checkpoint,
        eval_s=evaluation,
        other_s=max(0.0, wall_s - counted),
        failures=len(attempts) - 1,
        steps_redone=steps_redone,
    )


def job_goodput(job_dir: Path, status: JobStatus, beats: dict[int, list[Beat]], now: float) -> Goodput | None:
    """The goodput of the job in ``job_dir`` (None before it started), given the last attempt's latest
    beats by node_rank, from the first attempt's start to its end (``now`` while it runs: epoch
    seconds)."""
    return goodput_of(status, attempt_beats(job_dir, status, beats), now)


def goodput_of(status: JobStatus, each: list[Beat | None], now: float) -> Goodput | None:
    """``job_goodput`` from every attempt's rank 0 beat (``attempt_beats``). A requeued SLURM job's
    ``started_at`` is its last run's: the attempts say when it began."""
    if status.started_at is None:
        return None
    started = min([status.started_at, *(a.started_at for a in status.attempts)])
    return account(each, (status.ended_at or now) - started)


def attempt_beats(job_dir: Path, status: JobStatus, beats: dict[int, list[Beat]]) -> list[Beat | None]:
    """Rank 0's last beat of every attempt, oldest first: the archived ones', then the latest of
    ``beats`` (the running or last attempt's, by node_rank)."""
    last = rank0([b for node in beats.values() for b in node])
    return [*(archived_beat(job_dir, k) for k in range(1, len(status.attempts) + 1)), last]


def rank0(beats: list[Beat]) -> Beat | None:
    return next((b for b in beats if b.rank == 0), None)


def archived_beat(job_dir: Path, number: int) -> Beat | None:
    """Rank 0's last beat in archived attempt ``number`` (None where none was kept)."""
    beats_dir = job_dir / ATTEMPTS_DIR / str(number) / "heartbeat"
    return rank0([b for d in sorted(beats_dir.glob("node-*")) for b in read_beats(d)])
