"""The base of every scheduler whose job is followed by a supervisor on this machine (local, ssh,
compose): ``submit`` forks the supervisor with the scheduler's ``Transport``; ``state``, ``logs`` and
``cancel`` find the job again from its record, from any shell.

A subclass gives ``resolve``/``render``, ``transport`` and, where the default does not do, the other
hooks below (``preflight``, ``remaining``, ``sweep``).
"""

from __future__ import annotations

import signal
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from gptlaunch.contract import Beat
from launcher.job.logs import node_logs, wait_terminal
from launcher.job.plan import Plan
from launcher.job.progress import recorded_beats
from launcher.job.record import JobError, JobRecord, JobStatus
from launcher.job.spec import JobSpec
from launcher.job.verdict import controller_lost, gather, verdict
from launcher.supervisor import procs
from launcher.supervisor.supervisor import FAIL_FAST_GRACE_S, SupervisorHandle, start_supervisor
from launcher.supervisor.transport import Transport


class RecordFollowed(ABC):
    """``heartbeats`` and ``logs`` read from the job record, where the nodes' ranks beat and the nodes
    log (a scheduler whose ranks beat elsewhere overrides ``heartbeats``)."""

    @abstractmethod
    def state(self, record: JobRecord) -> JobStatus:
        """The job's status now (a followed log ends once it is terminal)."""

    def heartbeats(self, record: JobRecord) -> dict[int, list[Beat]]:
        return recorded_beats(record.plan(), record.dir)

    def logs(self, record: JobRecord, node: int | None, follow: bool) -> Iterator[str]:
        return node_logs(self.state, record, node, follow)


class SupervisedScheduler(RecordFollowed):
    name: str
    files_here: bool
    queued = False

    @abstractmethod
    def transport(self, plan: Plan, record: JobRecord) -> Transport:
        """How the supervisor starts, stops and explains this scheduler's node agents."""

    def preflight(self, spec: JobSpec, plan: Plan, job_dir: Path) -> Plan:
        """Nothing to try before a job (``Scheduler.preflight``): ``plan`` as it is."""
        return plan

    def remaining(self, record: JobRecord) -> str:
        """What of the job still runs without its supervisor ("" for nothing)."""
        found = procs.job_processes(record.job_id)
        return f"{len(found)} process(es) of the job are still stopping" if found else ""

    def sweep(self, record: JobRecord, grace_s: float) -> None:
        """Stop every process of the job: SIGTERM, SIGKILL after ``grace_s`` seconds."""
        procs.sweep(record.job_id, grace_s)

    def submit(self, plan: Plan, record: JobRecord, *, detach: bool) -> SupervisorHandle:
        return start_supervisor(plan, record, detach=detach)

    def state(self, record: JobRecord) -> JobStatus:
        status = record.status()
        if status.state.is_terminal:
            return status
        handle = record.handle(SupervisorHandle)
        if procs.alive(handle.supervisor if handle else status.submitter):
            return status
        status = record.status()  # it may have recorded the end just before exiting
        if status.state.is_terminal:
            return status
        remaining = self.remaining(record) if handle else ""
        if remaining:
            return status.model_copy(update={"message": f"its supervisor is gone; {remaining}"})
        outcome = controller_lost(record, status)
        try:
            return record.finish(outcome)
        except OSError:  # a read-only job dir: just report the end found out
            return status.model_copy(update=dict(outcome))

    def cancel(self, record: JobRecord, *, wait: bool = True) -> JobStatus:
        status = self.state(record)
        if status.state.is_terminal:
            return status
        handle = record.handle(SupervisorHandle)
        if handle is not None and procs.alive(handle.supervisor):
            if handle.supervisor.host != socket.gethostname():
                raise JobError(f"job {record.job_id} runs on host {handle.supervisor.host}: cancel it there")
            # The supervisor owns the job: it relays SIGTERM, waits for checkpoints, records the end.
            procs.signal_all(procs.processes([handle.supervisor.pid]), signal.SIGTERM)
            if not wait:
                return status
            grace = record.spec().grace_period_s
            final = wait_terminal(self.state, record, grace + 3 * FAIL_FAST_GRACE_S, poll_s=0.1)
            if final is not None:
                return final
        elif not wait:  # nothing to ask: the sweep below would block
            return status
        # Nothing follows the job (or its supervisor hangs): stop what is left ourselves.
        asked = time.time()
        self.sweep(record, record.spec().grace_period_s)
        if handle is not None and procs.alive(handle.supervisor):
            procs.terminate(procs.processes([handle.supervisor.pid]), FAIL_FAST_GRACE_S)
        return record.finish(verdict(replace(gather(record, asked), stop_requested=True)))
