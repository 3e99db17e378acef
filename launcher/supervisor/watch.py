"""One attempt, followed (``Watch``): the job a supervisor runs (``Job``) and the stop its signals
ask for (``StopOnSignal``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from types import FrameType

import psutil

from gptlaunch.contract import EXIT_CHECKPOINTED
from launcher.job import reports
from launcher.job.failures import killed_by
from launcher.job.hang import EXIT_HANG, HANG_REPORTS_S
from launcher.job.plan import Plan
from launcher.job.record import Attempt, Failing, JobRecord, JobState, JobStatus, Outcome
from launcher.job.scalars import JobScalars, goodput_point
from launcher.job.spec import JobSpec
from launcher.job.verdict import Facts, gather, verdict
from launcher.preflight import recorded
from launcher.supervisor import procs
from launcher.supervisor.transport import DRAIN_S, Transport, drain_channels

FAIL_FAST_GRACE_S = 5.0  # a failed job cannot checkpoint (a peer is gone): stop the rest quickly
POLL_S = 0.1
REPORT_READ_S = 1.0  # how often the job record is read for the nodes' hang reports


class StopAtOnce(BaseException):
    """A second stop request: stop waiting for checkpoints. Not an Exception: no handler of errors
    (the job's TensorBoard points, a read that may fail) may swallow it."""


class StopOnSignal:
    """SIGTERM, SIGINT and SIGHUP ask the job to stop; a second request while stopping: at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in procs.STOP_SIGNALS}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise StopAtOnce
        self.requested = True
        print(f"supervisor: {signal.Signals(signum).name}: stopping the job", file=sys.stderr, flush=True)

    def ignore(self) -> None:
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)

    def listen(self) -> None:
        """Undo ``ignore``."""
        for sig in self._previous:
            signal.signal(sig, self._handle)


@dataclass
class Job:
    """The job a supervisor follows: its Plan, record and transport; the current attempt's agents and
    start time, and the attempts that ended before it."""

    plan: Plan
    record: JobRecord
    transport: Transport
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    attempts: list[Attempt] = field(default_factory=list)
    reports: reports.Tail = field(init=False)  # what the nodes report from the attempt's start on
    spec: JobSpec = field(init=False)  # read once
    grace_s: float = field(init=False)  # the job's grace period (seconds)
    scalars: JobScalars = field(init=False)  # the job's numbers in TensorBoard

    def __post_init__(self) -> None:
        self.spec = self.record.spec()
        self.grace_s = self.spec.grace_period_s
        self.scalars = JobScalars(self.record.dir, self.record.status().created_at)
        self.reports = reports.Tail(self.record.dir)
        checks = recorded.read(self.record.dir, self.plan.nnodes)  # an SSH submit's health gate
        if checks.health is not None:
            self.scalars.health(checks.health, checks.hosts, self.started)

    def goodput_point(self, periodic: bool = False, status: JobStatus | None = None) -> None:
        goodput_point(self.scalars, self.record, self.plan, periodic=periodic, status=status)

    def next_attempt(self) -> None:
        self.agents, self.started = [], time.time()
        self.reports = reports.Tail(self.record.dir)


class Watch:
    """Follows the agents to the job's end: success, fail-fast on the first failure, or a stop. How
    the attempt ended is ``launcher.job.verdict``'s; this only gathers the facts at the right time."""

    def __init__(self, job: Job, stop: StopOnSignal) -> None:
        self.job, self.stop = job, stop
        self.stop_at: float | None = None
        # Each node's agent watches its ranks: it reports a hang and holds them for the others' dumps.
        self.node_watched = job.spec.hang.enabled
        self.next_read = self.next_stop_read = 0.0
        self.first_report: float | None = None
        self.codes: tuple[int | None, ...] = ()  # the agents' exit codes when the supervisor killed them
        self.told_failing = False  # the status says this attempt fails

    def run(self) -> Outcome:
        """The attempt's outcome, once it ended; the status names the failed rank, or no longer says
        the attempt fails when it did not (``_decided``)."""
        return self._decided(self._follow())

    def _follow(self) -> Outcome:
        job = self.job
        while True:
            codes = [a.poll() for a in job.agents]
            if all(c == 0 for c in codes):
                return self._verdict()
            if (self.stop.requested or self._stop_recorded()) and self.stop_at is None:
                self._begin_stop()
            failed = [k for k, c in enumerate(codes) if c not in (None, 0)]
            if self.stop_at is not None:
                if all(c is not None for c in codes) or time.monotonic() - self.stop_at > job.grace_s:
                    self._drain_ended()  # a host's stop marker comes on its channel
                    return self._verdict(stop=True)
            elif failed:
                # a node killed by a signal is the cause; a peer that saw it die in the same poll is not
                return self._failed(min(failed, key=lambda k: killed_by(codes[k]) is None))
            elif self.node_watched and self._hang_reported():
                self._failing()
                self._kill()  # releases the ranks the nodes hold for each other's dumps
                return self._verdict()
            elif not self.told_failing and self._rank_failed():
                self._failing()  # the nodes' agents end soon after: ``failed`` then
            job.goodput_point(periodic=True)
            time.sleep(POLL_S)

    def _facts(self, first: int | None = None, explained: str | None = None, stop: bool = False) -> Facts:
        """The attempt's facts now: the record's, the agents' exit codes (those seen before the
        supervisor killed any: ``codes``), ``first`` (the first failed node), what its transport made
        of its exit (``explained``), and whether a stop was asked."""
        job = self.job
        facts = replace(gather(job.record, job.started, job.plan), transport_error=explained)
        codes = self.codes or tuple(a.poll() for a in job.agents)
        return replace(facts, agents=codes, first_failed=first, stop_requested=stop)

    def _verdict(self, first: int | None = None, explained: str | None = None, stop: bool = False) -> Outcome:
        return verdict(self._facts(first, explained, stop))

    def _failing(self) -> None:
        """Say in the status, before anything is stopped, that this attempt fails: the console holds
        what the nodes print from then on until the verdict names the rank (``_decided``). Once."""
        if not self.told_failing:
            self.told_failing = True
            attempt = len(self.job.attempts) + 1
            self.job.record.update_status(failing=Failing(attempt=attempt, at=time.time()))

    def _rank_failed(self) -> bool:
        """Whether a node told of a failed rank since the last look (``reports.RankFailed``), one that
        did not stop with a checkpoint: before its torchrun has stopped the other ranks and ended."""
        told = self.job.reports.new()
        return any(isinstance(r, reports.RankFailed) and r.exit_code != EXIT_CHECKPOINTED for r in told)

    def _decided(self, outcome: Outcome) -> Outcome:
        """``outcome``, and in the status the rank it names (``Failing``): the console shows that rank's
        lines, and leaves the rest since the failure to the logs. No failure (a stop; a rank that
        torchrun restarted in place): nothing hidden."""
        failing, failure = self.job.record.status().failing, outcome.failure
        if failing is None or failing.attempt != len(self.job.attempts) + 1:
            return outcome  # this attempt was never said to fail
        if outcome.state != JobState.FAILED:
            self.job.record.update_status(failing=None)
            return outcome
        named = {"node": failure.node_rank, "rank": failure.rank} if failure is not None else {}
        self.job.record.update_status(failing=failing.model_copy(update={"decided": True, **named}))
        return outcome

    def _kill(self) -> None:
        """End every process of the attempt; the agents' exit codes until now are kept (``codes``):
        the ones the kill gives them say nothing of the attempt."""
        self.codes = tuple(a.poll() for a in self.job.agents)
        self.job.transport.kill(self.job.plan.job_id, FAIL_FAST_GRACE_S)

    def _hang_reported(self) -> bool:
        """Whether the nodes' own watchdogs reported a hang (read every REPORT_READ_S): once every
        node has reported, or HANG_REPORTS_S after the first (the job then ends as a hang, which
        releases the ranks the nodes hold for each other's dumps)."""
        job = self.job
        if time.monotonic() < self.next_read:
            return False
        self.next_read = time.monotonic() + REPORT_READ_S
        hangs = reports.hangs(job.record.dir, since=job.started)
        if not hangs:
            return False
        self.first_report = self.first_report or time.monotonic()
        return len(hangs) >= job.plan.nnodes or time.monotonic() - self.first_report >= HANG_REPORTS_S

    def _stop_recorded(self) -> bool:
        """Whether a stop was asked in the job record (read every REPORT_READ_S): how ``launcher
        cancel`` reaches a controller on another machine (SLURM's, in the allocation)."""
        if time.monotonic() < self.next_stop_read:
            return False
        self.next_stop_read = time.monotonic() + REPORT_READ_S
        if self.job.record.status().stop_requested_at is None:
            return False
        self.stop.requested = True  # never back to False: a signal may have asked meanwhile
        return True

    def _begin_stop(self) -> None:
        self.stop_at = time.monotonic()
        self.job.transport.stop(self.job.agents)

    def _drain_ended(self) -> None:
        """The channels of the agents that ended, read to their end (at most DRAIN_S)."""
        drain_channels(DRAIN_S, [a.pid for a in self.job.agents if a.poll() is not None])

    def _wait_others(self, seconds: float) -> None:
        """Give the agents still running ``seconds`` to end on their own, then read their channels."""
        psutil.wait_procs([psutil.Process(a.pid) for a in self.job.agents if a.poll() is None], seconds)
        self._drain_ended()

    def _failed(self, node: int) -> Outcome:
        """The attempt's end after ``node``'s agent failed first: the others get the time the facts
        call for (a stop's checkpoint, the other nodes' hang reports), then everything is killed."""
        job = self.job
        code = job.agents[node].poll()
        if code != EXIT_CHECKPOINTED:  # 75: the ranks stopped with a checkpoint, likely no failure
            self._failing()
        self._drain_ended()  # a host's stop marker comes on its channel
        explained = job.transport.explain(job.plan.nodes[node], code)  # once: it may note a lost host
        if code == EXIT_CHECKPOINTED and self._facts(node).marker is None:
            self._wait_others(job.grace_s)  # the marker is rank 0's: its node may end later
        if self._verdict(node, explained).state in (JobState.CHECKPOINTED, JobState.CANCELLED):
            # A stop signal from outside the launcher (a shutdown, a scheduler; no stop was asked here,
            # so only such a stop ends so): the ranks saved a checkpoint and exited 75, which torchrun
            # reports as a failure. Let every node finish so.
            self._wait_others(job.grace_s)
        elif code == EXIT_HANG:  # that node's watchdog reported a hang: so will the others', soon
            self._wait_others(HANG_REPORTS_S)
        self._kill()
        drain_channels(DRAIN_S)
        return self._verdict(node, explained)
