"""How a SLURM job starts the node agent (``launcher.agent.node``) on each node, on both paths: the
node's command, its output in the job record, under the node's hang watchdog.

submitit pickles a ``NodeTask`` (the Plan's command, environment and paths: no secret, they come from the
environment SLURM exports) and calls it once per node, one task per node. On SLURM's warning signal
(SIGUSR2) submitit calls ``checkpoint()`` on node 0's task: it waits until the ranks have saved their
checkpoint and exited, then hands submitit the same task to requeue; the requeued run resumes from the
run directory's checkpoint.

Exit status of a task, which srun (``--kill-on-bad-exit=1``) and the job's SLURM state reflect:
0 when the node's ranks finished; 75 on node 0 when the ranks stopped on request with a checkpoint
(other nodes exit 0 then, so that srun does not kill node 0 while it requeues); 1 when the node failed;
124 when its hang watchdog found the ranks stalled (their stacks are in its ``hang`` report).

The task's reports (``launcher.job.reports``: a hang with every rank's stack, a failed torchrun agent)
go into the job record, which SLURM's nodes share. The standalone sbatch script runs the same task
from its command line, ``python -m launcher.schedulers.slurm.task --job-dir D --run-dir R
[--nproc-per-node N --hang-*] -- ARGV``: srun writes its output to the node log, and with no launcher
to gather the nodes' reports, the task writes the stacks to ``D/hang/`` and the one-line cause to the
log itself.

Node 0's task writes the job's numbers into its TensorBoard logs (``points``), as the supervisor does
on the other schedulers. A run dir on each node's own disk (``launcher.schedulers.slurm.run_copy``)
is restored from its copy in the job record before the node agent starts, and each save is copied
there while the ranks run.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO

from gptlaunch.contract import EXIT_CHECKPOINTED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_REFUSED
from launcher.agent.node import NodeAgent, Output, log_writer
from launcher.image.runtime import ImageRun
from launcher.job import reports
from launcher.job.failures import stop_marker
from launcher.job.hang import (
    EXIT_HANG,
    HANG_REPORTS_S,
    add_watch_flags,
    heartbeat_dir,
    merge,
    parse_with_command,
    watch_of,
    write_stacks,
)
from launcher.job.verdict import hung
from launcher.schedulers.slurm.run_copy import RunCopy, node_local
from launcher.supervisor.watchdog import NodeWatch

# The node agent of this process and its run dir's copy (None: the run dir is shared), for
# checkpoint(): module state, so the task itself stays picklable.
_agent: NodeAgent | None = None
_copy: RunCopy | None = None
# The signals SLURM sent this task (SIGUSR2: its warning before a time limit or a preemption; SIGTERM:
# a cancel, or srun ending the step after another node failed) -> when: its ranks were stopped.
_signalled: dict[int, float] = {}
_started = 0.0  # when this run of the task started (epoch seconds)
MARKER_WAIT_S = 15.0  # beyond the grace period: a node-local rank 0's stop marker reaching the copy
# What the node command and the ranks read in a container: the plan's variables, SLURM's (with the
# GPUs it gave this job) and ours.
_PASSED_ON = ("SLURM_", "GPTLAUNCH_", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class NodeTask:
    argv: list[str]
    env: dict[str, str]
    job_dir: str
    run_dir: str
    grace_s: float  # seconds the ranks get to checkpoint after a stop signal
    watch: NodeWatch | None = None  # the hang watchdog of this node's ranks (None: off)
    standalone: bool = False  # run by the sbatch script: srun writes stdout to the node log
    image: ImageRun | None = None  # podman: the node's command runs in a container of the image
    job_id: str = ""  # the launcher's: the mark it wrote in a shared run dir (launcher.agent.copies)
    node_local_run_dir: bool | None = None  # declared; None: a run dir without the mark is node-local
    copy_exclude: tuple[str, ...] = ()  # dirs below the run dir its copy leaves out (prepared data)
    allow_start_over: bool = False  # start without the newest checkpoint when it is out of reach

    def __call__(self) -> int:
        node = int(os.environ.get("SLURM_NODEID", "0"))
        job_dir = Path(self.job_dir)
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        reports.append(job_dir, reports.Started(node=node, host=host))
        code = EXIT_FAILED
        try:
            if self.standalone:
                code = self._run(node, host, sys.stdout.buffer)
            else:
                with open(job_dir / f"node-{node}.log", "ab") as log:  # appended to across requeues
                    code = self._run(node, host, log)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else EXIT_FAILED
            raise
        finally:  # not when the task is killed: then it started and never ended (``reports.died``)
            reports.append(job_dir, reports.Ended(node=node, exit_code=code))
        return code

    def _run(self, node: int, host: str, log: BinaryIO) -> int:
        global _agent, _copy, _started
        started = _started = time.time()
        job_dir = Path(self.job_dir)
        env = os.environ | self.env  # the node command changes to the workdir itself
        hang_from = [time.time()]  # when this node's hang was found: the others' reports come after
        nnodes = int(os.environ.get("SLURM_NNODES", "1"))

        def everyone() -> bool:  # every node's hang report is in the shared job record
            return len(reports.hangs(job_dir, since=hang_from[0] - HANG_REPORTS_S)) >= nnodes

        def report(report: reports.NodeReport) -> None:
            if isinstance(report, reports.Hang):
                hang_from[0] = report.time
            reports.append(job_dir, report)

        log.flush()
        _note_signals()
        _copy = self._restored(node, host, log)
        # SLURM signals every process of the step (SIGUSR2 before the time limit, SIGTERM on scancel):
        # the ranks act on them, the agent relays none. The container's monitor (conmon) re-parents to
        # this task, not to init: under proctrack/linuxproc SLURM's signals and its final SIGKILL reach
        # it and the ranks (host processes: --pid=host). Under proctrack/cgroup podman's own cgroup
        # escapes that: then only the agent's removal of the container ends it.
        _agent = NodeAgent(
            node=node,
            argv=self.argv,
            env=env,
            report=report,
            say=log_writer(log),
            watch=self.watch,
            heartbeat_dir=str(heartbeat_dir(job_dir, node)) if self.watch is not None else None,
            image=self.image,
            container_name=f"gptlaunch-{os.environ.get('SLURM_JOB_ID', 'job')}-node{node}",
            env_names=[*self.env, *(k for k in env if k.startswith(_PASSED_ON))],
            output=Output(fd=log.fileno()),
            forward_signals=False,
            subreaper=self.image is not None,
            released=everyone,
        )
        try:
            code = _agent.run()
        except OSError as e:  # a mount that cannot be made, a command that cannot start
            log_writer(log)(f"task: cannot start the node's command: {e}")
            raise SystemExit(EXIT_FAILED) from None
        finally:
            ended = time.time()
            if _copy is not None:
                _copy.finish()
        return self._end(node, code, started, log, ended)

    def _restored(self, node: int, host: str, log: BinaryIO) -> RunCopy | None:
        """For a node-local run dir (``launcher.schedulers.slurm.run_copy``): its copy, restored into
        it and watching it (None for a shared run dir). Exits EXIT_REFUSED when the newest checkpoint
        is out of reach and starting over is not allowed, EXIT_FAILED when the restore fails."""
        run_dir, say = Path(self.run_dir), log_writer(log)
        if not node_local(run_dir, self.job_id, self.node_local_run_dir):
            return None
        copy = RunCopy(Path(self.job_dir), run_dir, node, host, say, self.copy_exclude)
        why = copy.refusal()
        if why is not None and not self.allow_start_over:
            refused = reports.Refused(node=node, check="checkpoint", exit_code=EXIT_REFUSED, message=why)
            reports.append(Path(self.job_dir), refused)
            say(f"task: not started: {why}")
            raise SystemExit(EXIT_REFUSED)
        if why is not None:
            say(f"task: warning: going on from an older checkpoint (--allow-start-over): {why}")
        try:
            copy.restore()
        except OSError as e:
            say(f"task: cannot restore the run dir {run_dir} from its copy: {e}")
            raise SystemExit(EXIT_FAILED) from None
        copy.start()
        return copy

    def _end(self, node: int, code: int, started: float, log: BinaryIO, ended: float) -> int:
        """The task's exit status (see the module docstring) for the node agent's ``code``; the agent
        ended at ``ended`` (epoch seconds)."""
        job_dir = Path(self.job_dir)
        if code == EXIT_HANG:
            if self.standalone:  # no launcher to gather the reports: say what they found
                merged = merge(reports.hangs(job_dir, since=started))
                write_stacks(job_dir, merged)
                log_writer(log)(f"task: {hung(job_dir, merged).message}")
            raise SystemExit(EXIT_HANG)
        if code == 0:
            return 0
        if self._stop_marker(started):  # stopped on request, checkpointed
            if node == 0:
                raise SystemExit(EXIT_CHECKPOINTED)
            return 0
        if _copy is not None and _signalled.get(signal.SIGTERM, ended + 1) <= ended:
            # Stopped by SLURM (a cancel, or srun ending the step after another node failed) before the
            # agent ended, with rank 0's stop marker (if any) on another node's disk: this node did not
            # fail on its own (a node that did is found by its own report, or as one that died). Node 0
            # exits non-zero all the same: a job whose tasks all exit 0 is COMPLETED, not stopped.
            log_writer(log)("task: the ranks stopped on SLURM's SIGTERM")
            if node == 0:
                raise SystemExit(EXIT_INTERRUPTED)
            return 0
        # Which node failed first, even when no rank could write an error file (a crash, a kill).
        reports.append(job_dir, reports.Failed(node=node, exit_code=code))
        raise SystemExit(EXIT_FAILED)

    def _stop_marker(self, since: float) -> bool:
        """Whether the ranks wrote a stop marker at or after ``since``: in the run dir or, for a
        node-local one, in its copy, where rank 0's node puts it once its ranks ended; so, after
        SLURM's warning signal (SIGUSR2), it is waited for (at most the grace period and
        MARKER_WAIT_S). Not after a SIGTERM: srun sends it too when another node failed."""
        job_dir = Path(self.job_dir) if _copy is not None else None
        warned = _signalled.get(signal.SIGUSR2) if _copy is not None else None
        # From the warning, not from now: all of a requeue's waits fit in SLURM's warning time.
        deadline = warned + self.grace_s + MARKER_WAIT_S if warned is not None else 0.0
        while stop_marker(Path(self.run_dir), since, job_dir) is None:
            if time.time() >= deadline:
                return False
            time.sleep(0.5)
        return True


def _note_signals() -> None:
    """Note SLURM's signals (SIGUSR2, SIGTERM) in ``_signalled``, then run the handler already set
    (submitit's, the standalone script's); none is set where the default would end the task."""
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        previous = signal.getsignal(sig)
        if callable(previous):
            signal.signal(sig, _noting(previous))


def _noting(previous: Callable[[int, FrameType | None], Any]) -> Callable[[int, FrameType | None], Any]:
    def handler(signum: int, frame: FrameType | None) -> Any:
        _signalled.setdefault(signum, time.time())
        return previous(signum, frame)

    return handler


def main(argv: list[str] | None = None) -> int:
    """The sbatch script's entry (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m launcher.schedulers.slurm.task", description="One node of a SLURM job, watched."
    )
    p.add_argument("--job-dir", required=True)
    p.add_argument("--run-dir", required=True)
    add_watch_flags(p)
    ImageRun.add_flags(p)
    p.add_argument("--node-local-run-dir", action="store_true", help="copy the run dir into the job record")
    p.add_argument("--copy-exclude", action="append", default=[], help="a dir below the run dir not copied")
    p.add_argument("--allow-start-over", action="store_true", help="start without the newest checkpoint")
    args, command = parse_with_command(p, argv)
    if not command:
        p.error("the node's command goes after --")
    # SLURM signals every process of the step (SIGUSR2 before the time limit, SIGTERM on scancel): the
    # ranks act on them; this task only waits for them (a Python handler: reset in the child by exec).
    for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    watch = NodeWatch(*found) if (found := watch_of(args)) else None
    task = NodeTask(
        command,
        {},
        args.job_dir,
        args.run_dir,
        grace_s=0.0,
        watch=watch,
        standalone=True,
        image=ImageRun.of(args),
        node_local_run_dir=args.node_local_run_dir,
        copy_exclude=tuple(args.copy_exclude),
        allow_start_over=args.allow_start_over,
    )
    return task()


if __name__ == "__main__":
    sys.exit(main())
