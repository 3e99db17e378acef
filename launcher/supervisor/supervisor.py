"""The supervisor: a process forked by ``launcher submit`` that starts one agent per node through the
scheduler's ``Transport`` (``launcher.supervisor.transport``: a torchrun child here, an ``ssh`` client, a
``docker start --attach``), follows them to the job's end and records it.

Fail fast: the first agent that fails brings the others down (SIGTERM, then SIGKILL after
FAIL_FAST_GRACE_S) and the root cause is read from torchelastic's error files. A stop request
(SIGTERM from ``launcher cancel``, or from the kernel when an attached ``launcher submit`` dies) is
relayed to every agent, whose ranks checkpoint and exit; a second one stops everything at once. No
process of the job outlives it: it is a child subreaper, every agent gets SIGTERM from the kernel if
the supervisor dies, and a final sweep finds strays by their ``GPTLAUNCH_JOB_ID``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import NoReturn

import psutil
from pydantic import BaseModel, ConfigDict

from gptlaunch.contract import (
    ATTEMPT_ENV,
    EXIT_CHECKPOINTED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    job_snapshots,
    read_stop_marker,
)
from launcher.job import reports
from launcher.job.failures import hang_outcome, killed_by, root_cause, stop_outcome
from launcher.job.hang import EXIT_HANG, HANG_REPORTS_S, merge
from launcher.job.plan import Plan
from launcher.job.record import Attempt, JobRecord, JobState, Outcome, ProcessRef
from launcher.job.retry import backoff_s, decide, end_attempt, furthest_step, next_in, not_retried
from launcher.job.scalars import JobScalars, goodput_point
from launcher.job.spec import JobSpec
from launcher.preflight import recorded
from launcher.supervisor import procs
from launcher.supervisor.transport import DRAIN_S, Transport, drain_channels

FAIL_FAST_GRACE_S = 5.0  # a failed job cannot checkpoint (a peer is gone): stop the rest quickly
POLL_S = 0.1
REPORT_READ_S = 1.0  # how often the job record is read for the nodes' hang reports


class SupervisorHandle(BaseModel):
    """How a job followed by a supervisor on this machine is found again (saved as handle.json): the
    scheduler, the supervisor and the pids of the processes it started (agents, ssh clients)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    scheduler: str  # the kind of the scheduler that wrote it
    supervisor: ProcessRef
    node_pids: list[int] = []


class _StopAtOnce(BaseException):
    """A second stop request: stop waiting for checkpoints. Not an Exception: no handler of errors
    (the job's TensorBoard points, a read that may fail) may swallow it."""


def start_supervisor(
    plan: Plan, record: JobRecord, transport: Transport, *, detach: bool
) -> SupervisorHandle:
    """Fork the supervisor (in its own session: a Ctrl-C on the terminal reaches only us) and return
    once it has started every agent (or failed to, which the status records). Attached (not
    ``detach``), the supervisor gets SIGTERM from the kernel if this process dies, even by SIGKILL,
    and stops the job with a checkpoint; detached, it is a grandchild re-parented to init, so it
    outlives us and is never our zombie."""
    _ensure_std_fds()  # so the pipe's fds are >= 3 and stay clear of the supervisor's stdio
    read_fd, write_fd = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # a fork copies unflushed buffers: printed twice
        if stream is not None:
            stream.flush()
    pid = os.fork()
    if pid == 0:  # never returns into the caller's code
        os.close(read_fd)
        if detach and os.fork() != 0:
            os._exit(0)
        supervise(plan, record, transport, ready_fd=write_fd, die_with_parent=not detach)
    os.close(write_fd)
    if detach:
        os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as ready:
        ready.read()  # EOF once every agent started, or the supervisor ended
    handle = record.handle(SupervisorHandle)
    if handle is None:  # the supervisor died before it wrote anything
        record.finish(Outcome(state=JobState.LOST, exit_code=EXIT_FAILED, message="the supervisor died"))
        return SupervisorHandle(scheduler=plan.scheduler, supervisor=ProcessRef(pid=pid, started=0.0))
    return handle


def _ensure_std_fds() -> None:
    """Open /dev/null on any of fds 0-2 that is closed (e.g. `launcher submit --detach <&-`)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # takes the lowest free fd: this one


def supervise(
    plan: Plan, record: JobRecord, transport: Transport, *, ready_fd: int, die_with_parent: bool
) -> NoReturn:
    """Run the job to its end in this (freshly forked) process, record the outcome and exit with the
    job's exit code. ``ready_fd`` is closed once every agent has started (or starting failed)."""
    code = EXIT_FAILED
    try:
        stop = _StopOnSignal()  # first: replaces the handlers inherited from the forking process
        os.setsid()
        if die_with_parent:
            procs.die_with_parent()
        record = JobRecord(record.dir.absolute())
        _detach_from_caller(record.dir / "supervisor.log", keep_fd=ready_fd)
        code = _run(_Job(plan, record, transport), ready_fd, stop)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)  # never unwind into the forking caller's stack


def _detach_from_caller(log: Path, keep_fd: int) -> None:
    """Output to ``log``, no input, no other inherited fd (a caller's pipe must see EOF when the caller
    exits, not when the job does), and no hold on the caller's working directory. ``keep_fd`` >= 3."""
    os.closerange(3, keep_fd)
    os.closerange(keep_fd + 1, os.sysconf("SC_OPEN_MAX"))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    null = os.open(os.devnull, os.O_RDONLY)
    for target, source in ((0, null), (1, fd), (2, fd)):
        os.dup2(source, target)
    os.close(fd)
    os.close(null)
    os.chdir("/")


@dataclass
class _Job:
    """The job a supervisor follows: its Plan, record and transport; the current attempt's agents and
    start time, and the attempts that ended before it."""

    plan: Plan
    record: JobRecord
    transport: Transport
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    attempts: list[Attempt] = field(default_factory=list)
    spec: JobSpec = field(init=False)  # read once
    grace_s: float = field(init=False)  # the job's grace period (seconds)
    scalars: JobScalars = field(init=False)  # the job's numbers in TensorBoard

    def __post_init__(self) -> None:
        self.spec = self.record.spec()
        self.grace_s = self.spec.grace_period_s
        self.scalars = JobScalars(self.record.dir, self.record.status().created_at)
        checks = recorded.read(self.record.dir, self.plan.nnodes)  # an SSH submit's health gate
        if checks.health is not None:
            self.scalars.health(checks.health, checks.hosts, self.started)

    def goodput_point(self, periodic: bool = False) -> None:
        goodput_point(self.scalars, self.record, self.plan, periodic=periodic)

    def next_attempt(self) -> None:
        self.agents, self.started = [], time.time()


def _run(job: _Job, ready_fd: int, stop: _StopOnSignal) -> int:
    procs.become_subreaper()
    handle = SupervisorHandle(scheduler=job.plan.scheduler, supervisor=procs.process_ref())
    job.record.write_handle(handle)
    ready = [ready_fd]

    def started() -> None:  # every agent of an attempt started: `launcher submit` may return
        job.record.write_handle(handle.model_copy(update={"node_pids": [a.pid for a in job.agents]}))
        if ready[0] >= 0:
            os.close(ready[0])
            ready[0] = -1

    try:
        outcome = _attempts(job, stop, started)
    except _StopAtOnce:
        message = "stopped at once on a second request, without waiting for checkpoints"
        outcome = Outcome(state=JobState.CANCELLED, exit_code=EXIT_INTERRUPTED, message=message)
    except Exception as e:  # the supervisor itself broke: record it, never leave "running" behind
        traceback.print_exc()
        message = f"launcher error: {e!r}"
        outcome = Outcome(state=JobState.FAILED, exit_code=EXIT_FAILED, message=message)
    finally:
        stop.ignore()  # cleanup must not be cut short by another signal
        job.transport.kill(job.plan.job_id, FAIL_FAST_GRACE_S)
        job.transport.close()
        drain_channels(DRAIN_S)  # the nodes' last output, in their logs before the end is recorded
    final = job.record.finish(outcome)
    # The ranks' in-memory snapshots on this machine (local nodes): nothing will resume from them now.
    shutil.rmtree(job_snapshots(job.plan.job_id), ignore_errors=True)
    job.goodput_point()  # the ended job's, as `launcher status` tells it
    job.scalars.close()
    if ready[0] >= 0:
        os.close(ready[0])
    return final.job_exit_code


def _attempts(job: _Job, stop: _StopOnSignal, started: Callable[[], None]) -> Outcome:
    """Run the job's attempts until one ends for good (``launcher.job.retry``); its outcome."""
    total = job.spec.retries + 1
    while True:
        outcome = _attempt(job, stop, started)
        detected = time.time()
        job.transport.keep_beats(job.record)
        step = furthest_step(job.record)
        decision = decide(outcome, step, job.attempts, job.spec.retries)
        if stop.requested:
            return outcome
        if not decision.retry:
            return not_retried(outcome, decision.why, job.attempts, job.spec.retries)
        job.transport.kill(job.plan.job_id, FAIL_FAST_GRACE_S)
        try:
            hosts = [job.plan.nodes[n].host for n in decision.without if n < len(job.plan.nodes)]
            plan = job.transport.renew(job.record, hosts[0] if hosts else None)
        except OSError as e:
            message = (
                f"attempt {len(job.attempts) + 2} of {total} could not be prepared: {e}; {outcome.cause}"
            )
            return Outcome(state=JobState.FAILED, exit_code=EXIT_FAILED, message=message)
        ended = end_attempt(job.record, outcome, number=len(job.attempts) + 1, started_at=job.started,
                            ended_at=detected, step=step, replaced=_replaced(job.plan, plan))  # fmt: skip
        job.attempts.append(ended)
        if plan is not None:
            job.plan = plan
            job.record.write_plan(plan)
        wait = backoff_s(job.spec.retry_backoff_s, job.attempts)
        message = next_in(ended, job.spec.retries, wait)
        print(f"supervisor: {message}", flush=True)
        job.record.update_status(attempt=ended.number + 1, attempts=job.attempts, message=message)
        job.goodput_point()  # the failed attempt's share, now that its beats are archived
        if _stop_within(stop, wait):
            message = f"cancelled before attempt {ended.number + 1} of {total} started; {ended.describe()}"
            return Outcome(state=JobState.CANCELLED, exit_code=EXIT_INTERRUPTED, message=message)
        job.next_attempt()
        job.record.update_status(message=f"attempt {ended.number + 1} of {total}; {ended.describe()}")


def _replaced(old: Plan, new: Plan | None) -> dict[str, str]:
    """host -> its replacement, between two Plans of the same job."""
    if new is None:
        return {}
    return {a.host: b.host for a, b in zip(old.nodes, new.nodes, strict=True) if a.host != b.host}


def _stop_within(stop: _StopOnSignal, seconds: float) -> bool:
    """Wait ``seconds`` unless a stop is requested first; whether it was."""
    deadline = time.monotonic() + seconds
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return stop.requested


def _attempt(job: _Job, stop: _StopOnSignal, started: Callable[[], None]) -> Outcome:
    """Start every node's agent and follow them to this attempt's end."""
    try:
        for node in job.plan.nodes:
            # Which attempt this is, for the program (``gptlaunch.runtime.attempt``; SLURM's requeues
            # say it with SLURM_RESTART_COUNT).
            node = node.model_copy(update={"env": node.env | {ATTEMPT_ENV: str(len(job.attempts) + 1)}})
            job.agents.append(job.transport.start(node, job.record))
    except OSError as e:  # bad cwd, interpreter gone, out of resources
        message = f"node {len(job.agents)} could not start: {e}"
        # `started` is not called: `launcher submit` returns once `_run` has recorded this end
        return Outcome(state=JobState.FAILED, exit_code=EXIT_FAILED, message=message)
    started()
    first_start = job.record.status().started_at or job.started
    if job.record.update_status(state=JobState.RUNNING, started_at=first_start).state.is_terminal:
        stop.requested = True  # cancelled while starting: stop what was started
    before = job.attempts[-1].cause if job.attempts else ""
    job.scalars.attempt(len(job.attempts) + 1, job.spec.retries + 1, before, job.started)
    return _Watch(job, stop).run()


class _Watch:
    """Follows the agents to the job's end: success, fail-fast on the first failure, or a stop."""

    def __init__(self, job: _Job, stop: _StopOnSignal) -> None:
        self.job, self.stop = job, stop
        self.stop_at: float | None = None
        self.stop_asked = 0.0  # wall-clock time of the stop request
        # Each node's agent watches its ranks: it reports a hang and holds them for the others' dumps.
        self.node_watched = job.spec.hang.enabled
        self.next_read = 0.0
        self.first_report: float | None = None

    def run(self) -> Outcome:
        job = self.job
        while True:
            codes = [a.poll() for a in job.agents]
            if all(c == 0 for c in codes):
                return Outcome(state=JobState.SUCCEEDED, exit_code=0)
            if self.stop.requested and self.stop_at is None:
                self._begin_stop()
            failed = [k for k, c in enumerate(codes) if c not in (None, 0)]
            if self.stop_at is not None:
                if all(c is not None for c in codes) or time.monotonic() - self.stop_at > job.grace_s:
                    self._drain_ended()  # a host's stop marker comes on its channel
                    return stop_outcome(job.plan, since=self.stop_asked)
            elif failed:
                # a node killed by a signal is the cause; a peer that saw it die in the same poll is not
                first = min(failed, key=lambda k: killed_by(codes[k]) is None)
                return self._failed(first, codes[first])
            elif self.node_watched and (outcome := self._node_reports()) is not None:
                return outcome
            job.goodput_point(periodic=True)
            time.sleep(POLL_S)

    def _node_reports(self) -> Outcome | None:
        """The hang the nodes' own watchdogs report (read every REPORT_READ_S): once every node has
        reported, or HANG_REPORTS_S after the first, the job ends as a hang (which releases the ranks
        the nodes hold for each other's dumps)."""
        job = self.job
        if time.monotonic() < self.next_read:
            return None
        self.next_read = time.monotonic() + REPORT_READ_S
        hangs = reports.hangs(job.record.dir, since=job.started)
        if not hangs:
            return None
        self.first_report = self.first_report or time.monotonic()
        if len(hangs) < job.plan.nnodes and time.monotonic() - self.first_report < HANG_REPORTS_S:
            return None
        job.transport.kill(job.plan.job_id, FAIL_FAST_GRACE_S)
        hosts = {n.node_rank: n.named_host for n in job.plan.nodes if n.named_host}
        return hang_outcome(job.record.dir, merge(hangs, hosts))

    def _begin_stop(self) -> None:
        self.stop_at, self.stop_asked = time.monotonic(), time.time()
        self.job.transport.stop(self.job.agents)

    def _drain_ended(self) -> None:
        """The channels of the agents that ended, read to their end (at most DRAIN_S)."""
        drain_channels(DRAIN_S, [a.pid for a in self.job.agents if a.poll() is not None])

    def _failed(self, node: int, code: int | None) -> Outcome:
        job = self.job
        self._drain_ended()  # a host's stop marker comes on its channel
        marker = read_stop_marker(Path(job.plan.run_dir), since=job.started)
        if marker is None and code == EXIT_CHECKPOINTED:  # the marker is rank 0's: its node may end later
            psutil.wait_procs([psutil.Process(a.pid) for a in job.agents if a.poll() is None], job.grace_s)
            self._drain_ended()
            marker = read_stop_marker(Path(job.plan.run_dir), since=job.started)
        if marker is not None and killed_by(code) is None:
            # A stop signal from outside the launcher (a shutdown, a scheduler): the ranks saved a
            # checkpoint and exited 75, which torchrun reports as a failure. Let every node finish so.
            psutil.wait_procs([psutil.Process(a.pid) for a in job.agents if a.poll() is None], job.grace_s)
            return stop_outcome(job.plan, since=job.started)
        if code == EXIT_HANG:  # that node's watchdog reported a hang: so will the others', soon
            psutil.wait_procs([psutil.Process(a.pid) for a in job.agents if a.poll() is None], HANG_REPORTS_S)
        job.transport.kill(job.plan.job_id, FAIL_FAST_GRACE_S)
        drain_channels(DRAIN_S)
        hangs = reports.hangs(job.record.dir, since=job.started)
        if hangs:
            hosts = {n.node_rank: n.named_host for n in job.plan.nodes if n.named_host}
            return hang_outcome(job.record.dir, merge(hangs, hosts))
        refusal = job.transport.refusal(job.record, job.started)
        if refusal is not None:
            return refusal
        explained = job.transport.explain(job.plan.nodes[node], code)
        failure = root_cause(job.record, job.plan.nnodes, node, code, transport_error=explained)
        return Outcome(
            state=JobState.FAILED, exit_code=EXIT_FAILED, failure=failure, message=failure.summary()
        )


class _StopOnSignal:
    """SIGTERM, SIGINT and SIGHUP ask the job to stop; a second request while stopping: at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in procs.STOP_SIGNALS}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise _StopAtOnce
        self.requested = True
        print(f"supervisor: {signal.Signals(signum).name}: stopping the job", file=sys.stderr, flush=True)

    def ignore(self) -> None:
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)
