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
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gptlaunch.contract import EXIT_CHECKPOINTED, EXIT_FAILED, read_stop_marker
from launcher.agent.node import NodeAgent, Output, log_writer
from launcher.image.runtime import ImageRun
from launcher.job import reports
from launcher.job.hang import (
    EXIT_HANG,
    HANG_REPORTS_S,
    add_watch_flags,
    hang_message,
    heartbeat_dir,
    merge,
    parse_with_command,
    watch_of,
    write_stacks,
)
from launcher.supervisor.watchdog import NodeWatch

# The node agent of this process, for checkpoint(): module state, so the task itself stays picklable.
_agent: NodeAgent | None = None
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

    def __call__(self) -> int:
        node = int(os.environ.get("SLURM_NODEID", "0"))
        job_dir = Path(self.job_dir)
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        reports.append(job_dir, reports.Started(node=node, host=host))
        code = EXIT_FAILED
        try:
            if self.standalone:
                code = self._run(node, sys.stdout.buffer)
            else:
                with open(job_dir / f"node-{node}.log", "ab") as log:  # appended to across requeues
                    code = self._run(node, log)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else EXIT_FAILED
            raise
        finally:  # not when the task is killed: then it started and never ended (``reports.died``)
            reports.append(job_dir, reports.Ended(node=node, exit_code=code))
        return code

    def _run(self, node: int, log: BinaryIO) -> int:
        global _agent
        started, job_dir = time.time(), Path(self.job_dir)
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
        return self._end(node, code, started, log)

    def _end(self, node: int, code: int, started: float, log: BinaryIO) -> int:
        """The task's exit status (see the module docstring) for the node agent's ``code``."""
        job_dir = Path(self.job_dir)
        if code == EXIT_HANG:
            if self.standalone:  # no launcher to gather the reports: say what they found
                merged = merge(reports.hangs(job_dir, since=started))
                stacks = write_stacks(job_dir, merged)
                log_writer(log)(f"task: {hang_message(merged, stacks)}")
            raise SystemExit(EXIT_HANG)
        if code == 0:
            return 0
        if read_stop_marker(Path(self.run_dir), started) is not None:  # stopped on request, checkpointed
            if node == 0:
                raise SystemExit(EXIT_CHECKPOINTED)
            return 0
        # Which node failed first, even when no rank could write an error file (a crash, a kill).
        reports.append(job_dir, reports.Failed(node=node, exit_code=code))
        raise SystemExit(EXIT_FAILED)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's hook on SIGUSR2 (node 0): the ranks got the signal too and are saving a checkpoint;
        wait for them to exit (the requeue would kill them), then requeue this same task."""
        from submitit.helpers import DelayedSubmission

        child = _agent.child if _agent is not None else None
        if child is not None:
            # Past the timeout, requeue anyway: the last periodic checkpoint is what resumes.
            _wait_exited(child.pid, timeout_s=self.grace_s + 30)
        return DelayedSubmission(self)


def _wait_exited(pid: int, timeout_s: float) -> None:
    """Wait until child ``pid`` has exited, without reaping it. Not Popen.wait: this runs in a signal
    handler that interrupted ``__call__``'s Popen.wait, which holds the Popen's lock until it returns."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
        except ChildProcessError:  # already reaped
            return
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    """The sbatch script's entry (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m launcher.schedulers.slurm.task", description="One node of a SLURM job, watched."
    )
    p.add_argument("--job-dir", required=True)
    p.add_argument("--run-dir", required=True)
    add_watch_flags(p)
    ImageRun.add_flags(p)
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
    )
    return task()


if __name__ == "__main__":
    sys.exit(main())
