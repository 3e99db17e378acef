"""A SLURM job's state from accounting (``sacct``), for a job whose controller is not running: one still
queued (or checking its nodes), and one that SLURM ended before its controller recorded the end
(``end_outcome``: its controller never started the nodes; ``lost_controller``: it did).

SLURM's states map to the common ``JobState`` (``job_state``). A requeued job goes back to ``pending``
and runs again under the same id: only SLURM's end states are ends.
"""

from __future__ import annotations

import math
import subprocess
import time
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict
from submitit.slurm.slurm import SlurmInfoWatcher

from launcher.job.record import JobRecord, JobState, Outcome
from launcher.job.verdict import controller_lost, gather, verdict

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


class SlurmHandle(BaseModel):
    """How a SLURM job is found again (saved as handle.json); ``submitit_folder`` is "" for a job
    submitted with plain sbatch (the standalone script)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    scheduler: Literal["slurm"] = "slurm"
    slurm_job_id: str
    submitit_folder: str


@dataclass(frozen=True)
class AccountingInfo:
    state: str  # SLURM's state word, e.g. RUNNING ("CANCELLED by 0" -> CANCELLED)
    exit_code: int | None  # the batch script's exit status (sacct's ExitCode "75:0" -> 75)
    start: float | None  # epoch seconds the current run started (after a requeue: the new run)
    reason: str = ""  # why a pending job waits (Resources, Priority, BeginTime, ...)
    job_id: str = ""  # SLURM's job id (its batch log: ``submitit/<id>_0_log.out``)


def _epoch(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:  # "Unknown", "None" while pending
        return None


class Accounting:
    """Job states from sacct, for one process (each launcher command has its own): one call per job at
    most every REFRESH_S seconds, read by submitit's parser; a failed call keeps the last answer, as
    submitit's watcher does (sacct's database can be briefly unreachable)."""

    def __init__(self) -> None:
        self._read: dict[str, tuple[float, dict[str, str]]] = {}

    def _sacct(self, slurm_job_id: str) -> dict[str, str]:
        at, raw = self._read.get(slurm_job_id, (-math.inf, {}))
        if time.monotonic() - at < REFRESH_S:
            return raw
        argv = ["sacct", "-o", SACCT_FIELDS, "--parsable2", "-j", slurm_job_id]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout
            raw = SlurmInfoWatcher().read_info(out).get(slurm_job_id, raw)
        except (OSError, subprocess.SubprocessError):
            pass
        self._read[slurm_job_id] = (time.monotonic(), raw)
        return raw

    def info(self, slurm_job_id: str) -> AccountingInfo | None:
        """The job's accounting record, None while sacct does not know it (just submitted)."""
        raw = self._sacct(slurm_job_id)
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


def end_outcome(info: AccountingInfo, record: JobRecord) -> Outcome:
    """How a job that SLURM reports ended, and whose controller never ran its nodes, did end
    (``launcher.job.verdict``): the checks' refusal in the job record since the job's last attempt,
    and what SLURM says (COMPLETED, CANCELLED, the batch script's exit code)."""
    status = record.status()
    started = info.start or status.started_at or status.created_at
    since = max([started, *(a.ended_at for a in status.attempts)])
    unexplained = (
        f"SLURM ended the job {info.state} (exit {info.exit_code}) before its controller started the "
        f"nodes: see the batch log in {record.dir}/submitit/ (or the standalone script's slurm-*.out)"
    )
    facts = replace(
        gather(record, since),
        completed=info.state == "COMPLETED",
        stop_requested=status.stop_requested_at is not None,
        scheduler_cancelled=info.state == "CANCELLED",
        unexplained=unexplained,
    )
    return verdict(facts)


def lost_controller(info: AccountingInfo, record: JobRecord) -> Outcome:
    """The end of a job whose controller SLURM ended before it recorded the end: SLURM's state says
    why (TIMEOUT, NODE_FAIL: its node lost, CANCELLED outside the launcher)."""
    outcome = controller_lost(record, record.status())
    said = f"SLURM ended job {info.job_id} {info.state} (exit {info.exit_code}) while its controller ran"
    return outcome.model_copy(update={"message": f"{said}: {outcome.message}"})
