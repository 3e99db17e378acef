"""Retries of a SLURM job (``--retries``): on a spare node of the allocation (``--spare-nodes``), else
the job requeues itself, excluding the node it failed on.

With ``--retries``, submitit's batch script ends with ``python -m launcher.schedulers.slurm.retry
--job-dir D [--node-step STEP] --since T --exit-code C`` (``steps.retry_lines``), run on the
allocation's first node once every node's task has ended. For a failure that may be retried
(``launcher.job.retry.refusal``) it archives the attempt in the job record and requeues the job under
the same SLURM job id (``scontrol requeuehold``, then ``update ExcNodeList=... StartTime=now+backoff``,
then ``release``); the next attempt resumes from the last
checkpoint on nodes other than the ones it failed on.

With ``--spare-nodes K`` the allocation holds K nodes more than the job's ``--nodes N``: the nodes'
step runs on its first N, and a failure is retried at once within the allocation, by this step, as a
new srun step (``--node-step``, the nodes' step of the batch script, run with ``--nodelist``) on the
survivors and as many spares as the failed nodes. No requeue, no second wait in the queue: the job
keeps its run (one line in ``sacct``), and the survivors their snapshots in memory. A node named by a
failure is left out of the rest of the job; once no spare is left, the next retry is a requeue.

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
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gptlaunch.contract import ATTEMPT_ENV, FIRST_HOST_ENV
from launcher.job.record import JobRecord
from launcher.job.retry import decide, furthest_step, retry_next, spares
from launcher.preflight import health_step, parity_step
from launcher.schedulers.slurm.options import SlurmOptions
from launcher.schedulers.slurm.state import AccountingInfo, end_outcome

# What the steps before training leave in the job directory, kept with their attempt.
# (Their reports stay in ``reports/``, told apart by time.)
STEP_FILES = (parity_step.PROBE_DIR, health_step.HEALTH_DIR)


def _hostnames(nodelist: str) -> list[str]:
    """The allocation's hosts in its order (a step's nodes are numbered in it), from ``scontrol show
    hostnames``."""
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


@dataclass(frozen=True)
class Next:
    """What follows a failed attempt: ``said`` (one line), and for a retry within the allocation its
    ``hosts`` (node order) and ``attempt`` number after ``wait_s`` seconds; no hosts: the job was
    requeued, or it ends."""

    said: str
    hosts: tuple[str, ...] = ()
    attempt: int = 0
    wait_s: float = 0.0


def retry(
    record: JobRecord, exit_code: int, since: float, ran: list[str] | None = None, stay: bool = False
) -> Next:
    """Decide on the attempt that ended with the nodes' step's ``exit_code`` (it started at ``since``,
    epoch seconds; ``ran``: its hosts in node order, default the allocation's first ``--nodes``), then
    retry it within the allocation (``stay``: the caller can run the step, with ``--spare-nodes``) or
    requeue the job."""
    spec, status = record.spec(), record.status()
    detected = time.time()
    info = AccountingInfo(state="FAILED", exit_code=exit_code, start=since, job_id=os.environ["SLURM_JOB_ID"])
    outcome = end_outcome(info, record)
    step = furthest_step(record)
    decision = decide(outcome, step, status.attempts, spec.retries)
    if status.stop_requested_at is not None or not decision.retry:
        return Next(f"not retried: {decision.why or 'stopped on request'}")
    hosts = _hostnames(os.environ["SLURM_JOB_NODELIST"])
    ran = ran or hosts[: spec.nnodes]
    blamed = [ran[n] for n in decision.without if n < len(ran)]
    avoid = {host for a in status.attempts for host in a.excluded} | set(blamed)
    nxt = _within(hosts, ran, avoid) if stay and spec.options(SlurmOptions).spare_nodes else None
    replaced = dict(zip(blamed, [h for h in nxt if h not in ran], strict=False)) if nxt else None
    retry = retry_next(
        record, outcome, history=status.attempts, started_at=since, ended_at=detected, step=step,
        replaced=replaced, excluded=blamed, steps=STEP_FILES,
        min_wait_s=0.0 if nxt else 1.0,  # a requeue's StartTime is in whole seconds
        where=" in this allocation" if nxt else "",
    )  # fmt: skip
    if nxt:
        return Next(retry.message, nxt, retry.attempt.number + 1, retry.wait_s)
    attempts = [*status.attempts, retry.attempt]
    excluded = sorted({host for a in attempts for host in a.excluded})
    why = requeue(os.environ["SLURM_JOB_ID"], excluded, retry.wait_s)
    return Next(retry.message + (f" (could not exclude {', '.join(excluded)}: {why})" if why else ""))


def _within(hosts: list[str], ran: list[str], avoid: set[str]) -> tuple[str, ...] | None:
    """The next step's hosts in the allocation ``hosts``, in its order: those of ``ran`` (the step that
    failed) not in ``avoid`` (named by this failure or an earlier one), and as many spares as it lost;
    None when too few spares are left."""
    survivors = [h for h in ran if h not in avoid]
    spare = spares(hosts, ran, avoid)[: len(ran) - len(survivors)]
    if len(survivors) + len(spare) < len(ran):
        return None
    return tuple(sorted([*survivors, *spare], key=hosts.index))


def run_step(node_step: list[str], hosts: tuple[str, ...], attempt: int) -> int:
    """The nodes' step (``srun ...``) on ``hosts``, as attempt ``attempt``; its exit status. SLURM
    numbers the step's nodes in the allocation's order, as ``hosts`` is."""
    env = os.environ | {ATTEMPT_ENV: str(attempt), FIRST_HOST_ENV: hosts[0]}  # the rendezvous host
    argv = [node_step[0], f"--nodelist={','.join(hosts)}", *node_step[1:]]
    return subprocess.run(argv, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    """The batch script's last step; exits with the last nodes' step's exit status (``--exit-code``,
    or a retry's within the allocation), whatever else happens here: the job's SLURM state must stay
    its last attempt's."""
    p = argparse.ArgumentParser(
        prog="python -m launcher.schedulers.slurm.retry", description="Retry a failed SLURM job attempt."
    )
    p.add_argument("--job-dir", type=Path, required=True)
    p.add_argument("--since", type=float, required=True, help="when the attempt started (epoch seconds)")
    p.add_argument("--exit-code", type=int, required=True, help="the attempt's srun exit status")
    p.add_argument("--node-step", help="the nodes' srun step (shell words), for retries on spare nodes")
    args = p.parse_args(argv)
    # SLURM's warning signal (`scancel --signal=USR2 --full`) is for the ranks: this step outlives it.
    signal.signal(signal.SIGUSR2, lambda *_: None)
    code, since, ran = int(args.exit_code), args.since, None
    while code != 0:
        try:
            next_ = retry(JobRecord(args.job_dir), code, since, ran, stay=args.node_step is not None)
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
            next_ = Next(f"not retried: {e}")
        print(f"batch: {next_.said}", flush=True)
        if not next_.hosts:
            break
        time.sleep(next_.wait_s)
        if JobRecord(args.job_dir).status().stop_requested_at is not None:  # a cancel meanwhile
            print("batch: not retried: stopped on request", flush=True)
            break
        since, ran = time.time(), list(next_.hosts)
        code = run_step(shlex.split(args.node_step or ""), next_.hosts, next_.attempt)
    return code


if __name__ == "__main__":
    sys.exit(main())
