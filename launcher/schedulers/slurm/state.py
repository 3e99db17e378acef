"""A SLURM job's state from accounting (``sacct``), and how it ended.

States are read through submitit's ``SlurmInfoWatcher`` (one batched ``sacct`` call, cached; at most one
call every REFRESH_S seconds per process) and mapped to the common ``JobState``. A requeued job goes
back to ``pending`` and runs again under the same id: only SLURM's end states are ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from submitit.slurm.slurm import SlurmInfoWatcher

from gptlaunch.contract import EXIT_CHECKPOINTED, EXIT_FAILED, EXIT_INTERRUPTED
from launcher.job import reports
from launcher.job.failures import hang_outcome, read_errors, root_cause, stop_marker, stop_outcome
from launcher.job.hang import merge
from launcher.job.record import Failure, JobRecord, JobState, Outcome
from launcher.job.retry import decide, furthest_step, not_retried

REFRESH_S = 2
SACCT_FIELDS = "JobID,State,ExitCode,Start,Reason,NodeList"

_STATES = {
    JobState.PENDING: {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "CONFIGURING"}
    # PREEMPTED is followed by a requeue when the job is requeueable (submitit reads it the same way).
    | {"RESIZING", "PREEMPTED"},
    JobState.RUNNING: {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "SUSPENDED", "STOPPED"},
    JobState.SUCCEEDED: {"COMPLETED"},
    JobState.CANCELLED: {"CANCELLED"},
    JobState.FAILED: {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED"},
}


@dataclass(frozen=True)
class AccountingInfo:
    state: str  # SLURM's state word, e.g. RUNNING ("CANCELLED by 0" -> CANCELLED)
    exit_code: int | None  # the batch script's exit status (sacct's ExitCode "75:0" -> 75)
    start: float | None  # epoch seconds the current run started (after a requeue: the new run)
    reason: str = ""  # why a pending job waits (Resources, Priority, BeginTime, ...)
    job_id: str = ""  # SLURM's job id (its batch log: ``submitit/<id>_0_log.out``)


class _Watcher(SlurmInfoWatcher):
    """submitit's sacct watcher, also reading the exit code and the start time."""

    def _make_command(self) -> list[str] | None:
        command = super()._make_command()
        if command is not None:
            command[command.index("-o") + 1] = SACCT_FIELDS
        return command

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        # submitit's list of unfinished words lacks some (SUSPENDED, REQUEUE_HOLD, ...): it would stop
        # asking sacct about a job that has not ended.
        words = self.get_state(job_id, mode=mode).split()
        state = job_state(words[0]) if words else None
        return state is not None and state.is_terminal


def _epoch(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:  # "Unknown", "None" while pending
        return None


class Accounting:
    """Job states from sacct, for one process (each launcher command has its own)."""

    def __init__(self) -> None:
        self._watcher = _Watcher(delay_s=REFRESH_S)

    def info(self, slurm_job_id: str) -> AccountingInfo | None:
        """The job's accounting record, None while sacct does not know it (just submitted)."""
        raw = self._watcher.get_info(slurm_job_id, mode="standard")
        if not raw.get("State"):
            return None
        status, _, _ = raw.get("ExitCode", "").partition(":")
        return AccountingInfo(
            state=raw["State"].split()[0],
            exit_code=int(status) if status.isdigit() else None,
            start=_epoch(raw.get("Start", "")),
            reason="" if raw.get("Reason", "None") == "None" else raw.get("Reason", ""),
            job_id=slurm_job_id,
        )


def job_state(slurm_state: str) -> JobState | None:
    """The common state of a SLURM state word; None for a word this table does not know."""
    return next((state for state, words in _STATES.items() if slurm_state in words), None)


def _first_failed_node(record: JobRecord, since: float) -> tuple[int, int | None] | None:
    """(node, its agent's exit code) of the first node whose task reported a failure in this run."""
    failed = reports.read(record.dir, reports.Failed, since)
    return (failed[0].node, failed[0].exit_code) if failed else None


def end_outcome(info: AccountingInfo, record: JobRecord) -> Outcome:
    """How a job that SLURM reports ended did end: succeeded; failed (exit 3) when the nodes' versions
    differ (the parity step, ``launcher.preflight.parity_step``) or the health gate named nodes
    (``launcher.preflight.health_step``); checkpointed when the ranks stopped with
    a checkpoint in this run (a cancel, a time limit without requeue); else cancelled or failed with
    the root cause (first failing rank from torchelastic's error files)."""
    plan, status = record.plan(), record.status()
    # This attempt's reports: a retry on spare nodes runs in the same allocation, after its start.
    started = info.start or status.started_at or status.created_at
    since = max([started, *(a.ended_at for a in status.attempts)])
    if info.state == "COMPLETED":
        return Outcome(state=JobState.SUCCEEDED, exit_code=0)
    if status.stop_requested_at is not None:  # a cancel (also during the steps before training)
        return stop_outcome(plan, since, record.dir)  # checkpointed, or cancelled (130) if none saved
    refused = reports.read(record.dir, reports.Refused, since)
    if refused:  # a step before training ended the job: nothing trained
        return Outcome(  # the nodes the health gate named are the ones a retry leaves out
            state=JobState.FAILED,
            exit_code=refused[-1].exit_code,
            message=refused[-1].message,
            suspect_nodes=refused[-1].nodes,
        )
    stopped = stop_marker(Path(plan.run_dir), since, record.dir) is not None
    # A task that died (its node crashed, it was killed) makes srun end the others with SIGTERM: their
    # ranks checkpoint and stop, but that stop is the failure's, not a stop on request.
    # A node whose task started and never ended in this run died with it (killed, its machine gone).
    died = reports.died(record.dir, since)
    stop = not died and (info.exit_code == EXIT_CHECKPOINTED or stopped)
    if stop:
        return stop_outcome(plan, since, record.dir)
    if info.state == "CANCELLED":
        message = "cancelled in SLURM before the ranks saved a checkpoint"
        return Outcome(state=JobState.CANCELLED, exit_code=EXIT_INTERRUPTED, message=message)
    hangs = reports.hangs(record.dir, since)
    if hangs:  # the nodes' watchdogs found the ranks hung, took their stacks and ended them
        return hang_outcome(record.dir, merge(hangs))
    first = _first_failed_node(record, since)
    if read_errors(record, plan.nnodes, since) or first is not None:
        node, code = first or (0, info.exit_code)
        failure = root_cause(record, plan.nnodes, node, code, since)
        summary = failure.summary()
        return Outcome(state=JobState.FAILED, exit_code=EXIT_FAILED, failure=failure, message=summary)
    if died:
        error = "its task ended without a word (killed, or its node failed) before any rank reported an error"
        failure = Failure(node_rank=died[0].node, host=died[0].host, error=error)
        return Outcome(
            state=JobState.FAILED, exit_code=EXIT_FAILED, failure=failure, message=failure.summary()
        )
    message = (
        f"SLURM ended the job {info.state} (exit {info.exit_code}) before any rank reported an error: "
        f"see {record.dir}/node-*.log and submitit/*.out there"
    )
    return Outcome(state=JobState.FAILED, exit_code=EXIT_FAILED, message=message)


def final_outcome(info: AccountingInfo, record: JobRecord) -> Outcome:
    """``end_outcome`` of a job SLURM reports ended; for a job that retries (its batch script
    requeues it while it may, ``launcher.schedulers.slurm.retry``), with why the last attempt was not
    retried."""
    outcome = end_outcome(info, record)
    spec, status = record.spec(), record.status()
    if not spec.retries or outcome.state != JobState.FAILED:
        return outcome
    decision = decide(outcome, furthest_step(record), status.attempts, spec.retries)
    why = decision.why or "the requeue failed: see the batch log in submitit/"  # it was to be retried
    return not_retried(outcome, why, status.attempts, spec.retries)
