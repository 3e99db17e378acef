"""Job-level retries (``JobSpec.retries``): whether a failed attempt is tried again, after how long,
and what of it is kept.

What is retried and what never is: ``JobSpec.retries``' description, decided in one place,
``refusal``. A retried attempt starts from the last checkpoint, which the trainer resumes from on its
own (``--resume auto``), without the node it blames.

Each ended attempt is archived in ``JOB/attempts/<k>/``: its node logs, torchrun's error files, the
hang stacks and heartbeats, its Plan and ``attempt.json`` (``record.Attempt``). The next attempt writes fresh
ones in their usual places, so every reader of "this attempt" (root cause, hang reports, following)
stays as it was.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from gptlaunch.contract import EXIT_CHECKPOINTED, EXIT_INTERRUPTED, EXIT_REFUSED, EXIT_USAGE
from launcher.job.hang import HANG_DIR
from launcher.job.record import Attempt, JobRecord, JobState, Outcome

ATTEMPTS_DIR = "attempts"
MAX_BACKOFF_S = 300.0
_NEVER = {
    EXIT_USAGE: "invalid input",
    EXIT_REFUSED: "the nodes were refused before training",
    EXIT_CHECKPOINTED: "stopped on request",
    EXIT_INTERRUPTED: "stopped on request",
}
# Exceptions a rank raises for a state no node would change (torchelastic's record names the type):
# the same weights and data fail the same way on any node.
PROGRAM_FAULTS = {"TrainingError": "a non-finite loss", "FloatingPointError": "a floating-point error"}


def backoff_s(base_s: float, attempts: Sequence[Attempt]) -> float:
    """Seconds to wait before the attempt after ``attempts`` (the job's failed attempts, oldest first).

    A failure that is new costs no wait: the first, and any whose attempt reached a step no earlier
    attempt had reached (training went on for a while, then one more rank or host failed: a wait
    would only add to what it costs). A failure that repeats with no new step (a crash loop, a host
    that keeps failing at start-up) waits ``base_s``, doubled for each further repeat in a row, at
    most MAX_BACKOFF_S (or ``base_s``, if longer): the same rule as Kubernetes' CrashLoopBackOff,
    whose count resets once a container has run well, with progress in steps standing for "well"."""
    repeats, furthest = 0, 0
    for k, attempt in enumerate(attempts):
        reached = attempt.step or 0  # None: no rank beat (it failed before the trainer started)
        repeats = 0 if k == 0 or reached > furthest else repeats + 1
        furthest = max(furthest, reached)
    if repeats == 0:
        return 0.0
    return min(base_s * 2 ** (repeats - 1), max(base_s, MAX_BACKOFF_S))


def _signature(cause: str) -> str:
    """A cause with its numbers (pids, ports, times, addresses) masked, and an archived attempt's log
    paths as the attempt's own (``archive`` moves them): what repeats in a bug."""
    return re.sub(rf"/{ATTEMPTS_DIR}/#/", "/", re.sub(r"\d+", "#", cause))


def spares(pool: Sequence[str], current: Collection[str], avoid: Collection[str]) -> list[str]:
    """The one choice of spares: the hosts of ``pool`` (a hostfile's order) that run none of the job's
    nodes (``current``) and were never named by a failure or the health gate (``avoid``)."""
    return [h for h in pool if h not in current and h not in avoid]


def refusal(outcome: Outcome, step: int | None, history: list[Attempt], retries: int) -> str | None:
    """The one retry decision, for every scheduler: why the attempt that ended with ``outcome`` at
    ``step`` is not retried, after the attempts in ``history`` (oldest first) and with ``retries``
    allowed in all; None: it is, without the nodes it blames (``Outcome.blamed_nodes``)."""
    if outcome.state != JobState.FAILED:
        return "it did not fail"
    named = outcome.exit_code == EXIT_REFUSED and bool(outcome.suspect_nodes)  # by the health gate: left out
    if outcome.exit_code in _NEVER and not named:
        return _NEVER[outcome.exit_code]
    fault = outcome.failure.exception if outcome.failure is not None else None
    if fault in PROGRAM_FAULTS:
        return f"a program fault ({PROGRAM_FAULTS[fault]}, {fault}) that a retry would repeat on any node"
    if fault == "NoSpaceError":  # the next attempt writes to the same disk, whose room is not checked here
        return "the run dir's file system is full: free room there, then submit again to resume"
    if len(history) >= retries:
        return f"no retries left (--retries {retries})"
    last = history[-1] if history else None
    repeated = last is not None and last.step == step and _signature(last.cause) == _signature(outcome.cause)
    if step is not None and repeated:
        return f"the same error at step {step:,} in two attempts in a row: a bug, bad data or a NaN"
    return None


def not_retried(outcome: Outcome, why: str, attempts: list[Attempt], retries: int) -> Outcome:
    """The job's outcome when the attempt that ended with ``outcome`` is not retried, for ``why``:
    a failure of a job that retries says which attempt it was and why it is the last."""
    if not retries or outcome.state != JobState.FAILED:
        return outcome
    note = f" (attempt {len(attempts) + 1} of {retries + 1}; not retried: {why})"
    return outcome.model_copy(update={"message": outcome.message + note})


def next_in(ended: Attempt, retries: int, wait_s: float) -> str:
    """The status line while the next attempt waits ``wait_s`` seconds to start."""
    when = f"in {wait_s:.0f} s" if wait_s >= 0.5 else "now"
    return f"{ended.describe()}; attempt {ended.number + 1} of {retries + 1} starts {when}"


@dataclass(frozen=True)
class Retry:
    """A failed attempt archived and the next one announced: it starts in ``wait_s`` seconds, and the
    status says ``message``."""

    attempt: Attempt
    wait_s: float
    message: str


def retry_next(
    record: JobRecord,
    outcome: Outcome,
    *,
    history: list[Attempt],
    started_at: float,
    ended_at: float,
    step: int | None,
    replaced: dict[str, str] | None = None,
    excluded: list[str] | None = None,
    steps: Sequence[str] = (),
    min_wait_s: float = 0.0,
) -> Retry:
    """The one bookkeeping after an attempt that is retried, for every controller: the attempt after
    ``history`` (the job's ended attempts, oldest first), which ran from ``started_at`` to ``ended_at``
    (epoch seconds, its end detected) and reached ``step``, archived now that its processes are gone
    and the next nodes chosen (``archive``, with the files ``steps`` of the job directory: those of
    the steps before training); the backoff before the next (``backoff_s``, at least ``min_wait_s``);
    the status updated to say when it starts."""
    spec = record.spec()
    attempt = Attempt(
        number=len(history) + 1,
        started_at=started_at,
        ended_at=ended_at,
        cleaned_at=time.time(),
        exit_code=outcome.exit_code,
        cause=outcome.cause,
        step=step,
        failure=outcome.failure,
        replaced=replaced or {},
        excluded=excluded or [],
    )
    ended = archive(record, attempt, steps)
    attempts = [*history, ended]
    wait = max(backoff_s(spec.retry_backoff_s, attempts), min_wait_s)
    message = next_in(ended, spec.retries, wait)
    record.update_status(attempt=ended.number + 1, attempts=attempts, message=message)
    return Retry(ended, wait, message)


def archive(record: JobRecord, attempt: Attempt, steps: Sequence[str] = ()) -> Attempt:
    """Move the attempt's node logs, error files, hang stacks, heartbeats and ``steps`` (more files of
    the job directory) into ``JOB/attempts/<k>/`` with a copy of its Plan and ``attempt.json``;
    returns the attempt with the paths in its cause moved along."""
    out = record.dir / ATTEMPTS_DIR / str(attempt.number)
    out.mkdir(parents=True, exist_ok=True)
    moved = [n.log for n in record.plan().nodes] + ["torchelastic", HANG_DIR, "heartbeat", *steps]
    for name in moved:
        if (record.dir / name).exists():
            shutil.move(record.dir / name, out / name)
    shutil.copy2(record.dir / "plan.json", out / "plan.json")  # its hosts: a retry may change them

    def along(text: str) -> str:
        for name in moved:
            text = text.replace(str(record.dir / name), str(out / name))
        return text

    failure = attempt.failure
    if failure is not None:
        failure = failure.model_copy(update={"error": along(failure.error)})
    attempt = attempt.model_copy(update={"cause": along(attempt.cause), "failure": failure})
    (out / "attempt.json").write_text(attempt.model_dump_json(indent=2) + "\n")
    return attempt
