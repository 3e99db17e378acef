"""Retries of a SLURM job (``--retries``): the job requeues itself, excluding the node it failed on.

With ``--retries``, submitit's batch script ends with ``python -m launcher.schedulers.slurm.retry
--job-dir D --since T --exit-code C`` (``launcher.schedulers.slurm.steps.retry_lines``), run on the
allocation's first node once every node's task has ended. For a
failure that may be retried (``launcher.job.retry.refusal``) it archives the attempt in the job record
and requeues the job under the same SLURM job id (``scontrol requeuehold``, then ``update
ExcNodeList=... StartTime=now+backoff``, then ``release``); the next attempt resumes from the last
checkpoint on nodes other than the ones it failed on.

Why a requeue and not a new allocation: a queued job has nothing of ours running to submit one
(``launcher submit`` returned long ago, and the retry must happen with no shell open), the job keeps
its id (``squeue``, ``sacct``, ``scancel`` and the handle stay valid), and SLURM's own requeue is what
preemption already uses. Why the hold: SLURM refuses to change the excluded nodes of a running job, so
the job is first made pending and held, which also ends this batch step: SIGTERM to its processes,
which this one ignores for the few seconds the update and release take (SIGKILL follows only after
SLURM's KillWait, 30 s by default).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launcher.job.record import JobRecord
from launcher.job.retry import backoff_s, decide, end_attempt, furthest_step, next_in
from launcher.preflight import health_step, parity_step
from launcher.schedulers.slurm.state import AccountingInfo, end_outcome

# What the steps before training leave in the job directory, kept with their attempt.
# (Their reports stay in ``reports/``, told apart by time.)
STEP_FILES = (parity_step.PROBE_DIR, health_step.HEALTH_DIR)


def _hostnames(nodelist: str) -> list[str]:
    """The allocation's hosts by node index (SLURM_NODEID order), from ``scontrol show hostnames``."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.split()


def _scontrol(*args: str) -> None:
    """Raises subprocess.CalledProcessError with scontrol's error."""
    subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60, check=True)


def requeue(slurm_job_id: str, excluded: list[str], wait_s: float) -> str | None:
    """Requeue the job to start again after ``wait_s`` seconds on nodes other than ``excluded``; why
    the exclusion could not be set (the job then requeues without it), or None."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by scontrol: the hold ends this step
    _scontrol("requeuehold", slurm_job_id)
    why = None
    try:
        start = f"StartTime=now+{math.ceil(wait_s)}"
        _scontrol("update", f"JobId={slurm_job_id}", f"ExcNodeList={','.join(excluded)}", start)
    except subprocess.CalledProcessError as e:
        why = e.stderr.strip() or str(e)
    _scontrol("release", slurm_job_id)
    return why


def retry(record: JobRecord, exit_code: int, since: float) -> str:
    """Decide on the attempt that ended with the batch step's ``exit_code`` (it started at ``since``,
    epoch seconds) and requeue the job when it is retried; what was done, one line."""
    spec, status = record.spec(), record.status()
    detected = time.time()
    info = AccountingInfo(state="FAILED", exit_code=exit_code, start=since, job_id=os.environ["SLURM_JOB_ID"])
    outcome = end_outcome(info, record)
    step = furthest_step(record)
    decision = decide(outcome, step, status.attempts, spec.retries)
    if status.stop_requested_at is not None or not decision.retry:
        return f"not retried: {decision.why or 'stopped on request'}"
    hosts = _hostnames(os.environ["SLURM_JOB_NODELIST"])
    blamed = [hosts[n] for n in decision.without if n < len(hosts)]
    ended = end_attempt(record, outcome, number=len(status.attempts) + 1, started_at=since,
                        ended_at=detected, step=step, excluded=blamed, steps=STEP_FILES)  # fmt: skip
    attempts = [*status.attempts, ended]
    wait = max(backoff_s(spec.retry_backoff_s, ended.number), 1.0)
    message = next_in(ended, spec.retries, wait)
    record.update_status(attempt=ended.number + 1, attempts=attempts, message=message)
    excluded = sorted({host for a in attempts for host in a.excluded})
    why = requeue(os.environ["SLURM_JOB_ID"], excluded, wait)
    return message + (f" (could not exclude {', '.join(excluded)}: {why})" if why else "")


def main(argv: list[str] | None = None) -> int:
    """The batch script's last step; exits with ``--exit-code``, the batch step's, whatever happens
    here (the job's SLURM state must stay the attempt's)."""
    p = argparse.ArgumentParser(
        prog="python -m launcher.schedulers.slurm.retry", description="Retry a failed SLURM job attempt."
    )
    p.add_argument("--job-dir", type=Path, required=True)
    p.add_argument("--since", type=float, required=True, help="when the attempt started (epoch seconds)")
    p.add_argument("--exit-code", type=int, required=True, help="the attempt's srun exit status")
    args = p.parse_args(argv)
    if args.exit_code == 0:
        return 0
    try:
        print(f"batch: {retry(JobRecord(args.job_dir), args.exit_code, args.since)}", flush=True)
    except (OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
        print(f"batch: not retried: {e}", flush=True)
    return int(args.exit_code)


if __name__ == "__main__":
    sys.exit(main())
