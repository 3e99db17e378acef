"""The supervisor, the job's controller: the program ``launcher supervise --job-dir DIR`` (``supervise``),
which ``launcher submit`` starts (``start_supervisor``; on SLURM, the job's allocation runs it), runs
the job's attempts in the foreground: it starts one agent per node through the scheduler's
``Transport`` (``launcher.supervisor.transport``: a torchrun child here, an ``ssh`` client, a ``docker
start --attach``, an ``srun`` step), follows them to each attempt's end (``launcher.supervisor.watch``),
retries, hands the job back to its scheduler for a new allocation (a SLURM requeue), or ends the job
(``launcher.job.retry``) and records it. A stop asked in the job record (``launcher cancel`` of a
controller on another machine) is a stop request too.

Fail fast and stop requests: ``launcher.supervisor.watch``. No process of the job outlives it
(``launcher.supervisor.procs``).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from pydantic import BaseModel, ConfigDict

from gptlaunch.contract import (
    ATTEMPT_ENV,
    EXIT_CHECKPOINTED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    job_snapshots,
)
from launcher.job.plan import Plan
from launcher.job.progress import last_step, recorded_beats
from launcher.job.record import JobRecord, JobState, Outcome, ProcessRef
from launcher.job.retry import not_retried, refusal, retry_next
from launcher.job.verdict import Facts, verdict
from launcher.preflight import health_step, parity_step
from launcher.supervisor import procs
from launcher.supervisor.transport import DRAIN_S, NewAllocation, Transport, drain_channels
from launcher.supervisor.watch import FAIL_FAST_GRACE_S, Job, StopAtOnce, StopOnSignal, Watch

POLL_S = 0.1
CHECK_DIRS = (parity_step.PROBE_DIR, health_step.HEALTH_DIR)  # the checks' output in the job record


class SupervisorHandle(BaseModel):
    """How a job followed by a supervisor on this machine is found again (saved as handle.json): the
    scheduler, the supervisor and the pids of the processes it started (agents, ssh clients)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    scheduler: str  # the kind of the scheduler that wrote it
    supervisor: ProcessRef
    node_pids: list[int] = []


def start_supervisor(plan: Plan, record: JobRecord, *, detach: bool) -> SupervisorHandle:
    """Start the job's controller, ``launcher supervise --job-dir DIR`` (``supervise`` in a program of
    its own, in its own session: a Ctrl-C on the terminal reaches only us), and return once it has
    started every agent (or failed to, which the status records). Attached (not ``detach``), the
    supervisor gets SIGTERM from the kernel if this process dies, even by SIGKILL, and stops the job
    with a checkpoint; detached, it is a grandchild re-parented to init, so it outlives us and is
    never our zombie. Its output goes to ``JOB/supervisor.log``."""
    _ensure_std_fds()  # so the pipe's fds are >= 3 and stay clear of the supervisor's stdio
    read_fd, write_fd = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # a fork copies unflushed buffers: printed twice
        if stream is not None:
            stream.flush()
    job_dir = record.dir.absolute()
    argv = [sys.executable, *SUPERVISE, "--job-dir", str(job_dir), "--ready-fd", str(write_fd)]
    pid = os.fork()
    if pid == 0:  # never returns into the caller's code
        _exec_supervisor(argv, job_dir / "supervisor.log", read_fd, write_fd, detach)
    os.close(write_fd)
    if detach:
        os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as ready:
        ready.read()  # EOF once every agent started, or the supervisor ended
    handle = record.handle(SupervisorHandle)
    if handle is None:  # the supervisor died before it wrote anything (its log says why)
        message = f"the supervisor died before it started the job: see {job_dir / 'supervisor.log'}"
        record.finish(Outcome(state=JobState.LOST, exit_code=EXIT_FAILED, message=message))
        return SupervisorHandle(scheduler=plan.scheduler, supervisor=ProcessRef(pid=pid, started=0.0))
    return handle


SUPERVISE = ["-m", "launcher.cli.supervise"]  # what `launcher supervise` runs


def _exec_supervisor(argv: list[str], log: Path, read_fd: int, ready_fd: int, detach: bool) -> NoReturn:
    """In the forked child: become the supervisor's process (a session of its own, SIGTERM when the
    caller dies unless ``detach``, output to ``log``) and exec ``argv``."""
    try:
        # Blocked until the program's own handlers are in place (a mask is kept across exec): a
        # Ctrl-C meanwhile must not end it with the caller's handlers.
        signal.pthread_sigmask(signal.SIG_BLOCK, procs.STOP_SIGNALS)
        os.close(read_fd)
        if detach and os.fork() != 0:
            os._exit(0)
        os.setsid()
        if not detach:
            procs.die_with_parent()  # kept across exec
        _detach_from_caller(log, keep_fd=ready_fd)
        os.set_inheritable(ready_fd, True)
        os.execv(argv[0], argv)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(EXIT_FAILED)  # never unwind into the forking caller's stack


def _ensure_std_fds() -> None:
    """Open /dev/null on any of fds 0-2 that is closed (e.g. `launcher submit --detach <&-`)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # takes the lowest free fd: this one


def supervise(record: JobRecord, transport: Transport, *, ready_fd: int = -1, handle: bool = True) -> int:
    """Run the job of ``record`` (its Plan, through ``transport``) to its end in this process, in the
    foreground: every attempt, and the end recorded. Returns the job's exit code. ``ready_fd`` (when
    >= 0) is closed once every agent of the first attempt started (or starting failed). ``handle``:
    this process is how the job is found again (its handle, a ``SupervisorHandle``); not where the
    scheduler's own handle finds it (SLURM's job id). SIGTERM, SIGINT and SIGHUP stop the job with a
    checkpoint; a second one, at once."""
    stop = StopOnSignal()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, procs.STOP_SIGNALS)
    try:
        # A SLURM job requeued carries on with the attempts of its earlier allocations.
        job = Job(record.plan(), record, transport, attempts=list(record.status().attempts))
        return _run(job, ready_fd, stop, handle)
    except BaseException:
        traceback.print_exc()
        return EXIT_FAILED


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


def _run(job: Job, ready_fd: int, stop: StopOnSignal, own_handle: bool) -> int:
    procs.become_subreaper()
    handle = SupervisorHandle(scheduler=job.plan.scheduler, supervisor=procs.process_ref())
    if own_handle:
        job.record.write_handle(handle)
    ready = [ready_fd]

    def started() -> None:  # every agent of an attempt started: `launcher submit` may return
        if own_handle:
            job.record.write_handle(handle.model_copy(update={"node_pids": [a.pid for a in job.agents]}))
        if ready[0] >= 0:
            os.close(ready[0])
            ready[0] = -1

    try:
        outcome = _attempts(job, stop, started)
    except StopAtOnce:
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
    if outcome.state == JobState.PENDING:  # handed back to the scheduler (``_handed_over``): no end
        return 0
    # The ranks' in-memory snapshots on this machine (local nodes): nothing will resume from them now.
    shutil.rmtree(job_snapshots(job.plan.job_id), ignore_errors=True)
    # The ended job's goodput, as `launcher status` will tell it, before the end is recorded: whoever
    # sees the end finds nothing of the job at work, this process included (it exits next).
    ended_at = time.time()
    job.goodput_point(status=job.record.status().model_copy(update={**dict(outcome), "ended_at": ended_at}))
    job.scalars.close()
    final = job.record.finish(outcome, ended_at)
    if ready[0] >= 0:
        os.close(ready[0])
    return final.job_exit_code


def _attempts(job: Job, stop: StopOnSignal, started: Callable[[], None]) -> Outcome:
    """Run the job's attempts until one ends for good (``launcher.job.retry``); its outcome."""
    total = job.spec.retries + 1
    while True:
        outcome = _attempt(job, stop, started)
        detected = time.time()
        job.transport.keep_beats(job.record)
        step = last_step(recorded_beats(job.record.plan(), job.record.dir))
        why = refusal(outcome, step, job.attempts, job.spec.retries)
        if stop.requested:
            return outcome
        if outcome.exit_code == EXIT_CHECKPOINTED:  # stopped from outside: the scheduler may requeue it
            return _handed_over(job, stop, outcome, (), 0.0) or outcome
        if why is not None:
            return not_retried(outcome, why, job.attempts, job.spec.retries)
        job.transport.kill(job.plan.job_id, FAIL_FAST_GRACE_S)
        elsewhere = False
        try:
            blamed = [job.plan.nodes[n].host for n in outcome.blamed_nodes() if n < len(job.plan.nodes)]
            plan = job.transport.renew(job.record, blamed)
        except NewAllocation:  # retried in a new allocation, once this attempt is recorded
            plan, elsewhere = None, True
        except OSError as e:
            message = (
                f"attempt {len(job.attempts) + 2} of {total} could not be prepared: {e}; {outcome.cause}"
            )
            return Outcome(state=JobState.FAILED, exit_code=EXIT_FAILED, message=message)
        retry = retry_next(job.record, outcome, history=job.attempts, started_at=job.started,
                           ended_at=detected, step=step, replaced=_replaced(job.plan, plan),
                           excluded=blamed if elsewhere else None,
                           steps=CHECK_DIRS if elsewhere else (),  # a new allocation checks again
                           min_wait_s=1.0 if elsewhere else 0.0)  # fmt: skip
        job.attempts.append(retry.attempt)
        if elsewhere:
            excluded = sorted({host for a in job.attempts for host in a.excluded})
            handed = _handed_over(job, stop, outcome, excluded, retry.wait_s)
            if handed is None:
                return not_retried(outcome, "no node left to retry on", job.attempts[:-1], job.spec.retries)
            return handed
        if plan is not None:
            job.plan = plan
            job.record.write_plan(plan)
        print(f"supervisor: {retry.message}", flush=True)
        job.goodput_point()  # the failed attempt's share, now that its beats are archived
        number = retry.attempt.number + 1
        if _stop_within(stop, retry.wait_s):
            message = f"cancelled before attempt {number} of {total} started; {retry.attempt.describe()}"
            return Outcome(state=JobState.CANCELLED, exit_code=EXIT_INTERRUPTED, message=message)
        job.next_attempt()
        job.record.update_status(message=f"attempt {number} of {total}; {retry.attempt.describe()}")


def _handed_over(
    job: Job, stop: StopOnSignal, outcome: Outcome, excluded: Sequence[str], wait_s: float
) -> Outcome | None:
    """The job handed back to its scheduler for a new allocation (``Transport.requeue``) after the
    attempt that ended with ``outcome``: a pending outcome, recorded with the attempt's last goodput
    point first (the requeue ends this process's allocation; each point is flushed as written, so the
    writer stays open for the end's point where the scheduler does not requeue); None when the
    scheduler does not."""
    job.goodput_point()
    stop.ignore()  # the requeue signals this process too
    said = job.transport.requeue(job.record, outcome, excluded, wait_s)
    if said is None:
        stop.listen()
        return None
    print(f"supervisor: {said}", flush=True)
    job.record.update_status(state=JobState.PENDING, message=said, failing=None)
    return Outcome(state=JobState.PENDING, exit_code=0, message=said)


def _replaced(old: Plan, new: Plan | None) -> dict[str, str]:
    """host -> its replacement, between two Plans of the same job."""
    if new is None:
        return {}
    return {a.host: b.host for a, b in zip(old.nodes, new.nodes, strict=True) if a.host != b.host}


def _stop_within(stop: StopOnSignal, seconds: float) -> bool:
    """Wait ``seconds`` unless a stop is requested first; whether it was."""
    deadline = time.monotonic() + seconds
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return stop.requested


def _attempt(job: Job, stop: StopOnSignal, started: Callable[[], None]) -> Outcome:
    """Start every node's agent and follow them to this attempt's end."""
    refused = job.transport.refused(job.record)
    if refused is not None:  # a check before this controller refused its first nodes
        return verdict(Facts(plan=job.plan, job_dir=job.record.dir, refused=refused))
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
    running = job.record.update_status(
        state=JobState.RUNNING, started_at=first_start, attempt_started_at=job.started
    )
    if running.state.is_terminal:
        stop.requested = True  # cancelled while starting: stop what was started
    before = job.attempts[-1].cause if job.attempts else ""
    job.scalars.attempt(len(job.attempts) + 1, job.spec.retries + 1, before, job.started)
    return Watch(job, stop).run()
