"""What runs on each node of a SLURM job: that node's command, its output in the job record, under
the node's hang watchdog.

submitit pickles a ``NodeTask`` (the Plan's command, environment and paths: no secret, they come from the
environment SLURM exports) and calls it once per node, one task per node. On SLURM's warning signal
(SIGUSR2) submitit calls ``checkpoint()`` on node 0's task: it waits until the ranks have saved their
checkpoint and exited, then hands submitit the same task to requeue; the requeued run resumes from the
run directory's checkpoint.

Exit status of a task, which srun (``--kill-on-bad-exit=1``) and the job's SLURM state reflect:
0 when the node's ranks finished; 75 on node 0 when the ranks stopped on request with a checkpoint
(other nodes exit 0 then, so that srun does not kill node 0 while it requeues); 1 when the node failed;
124 when its hang watchdog found the ranks stalled (their stacks and the report are in the node log).

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
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from launcher.image.runtime import ImageRun
from launcher.job import reports
from launcher.job.hang import (
    EXIT_HANG,
    HANG_REPORTS_S,
    HangReport,
    add_watch_flags,
    hang_message,
    heartbeat_dir,
    merge,
    parse_with_command,
    watch_of,
    write_stacks,
)
from launcher.supervisor import procs
from launcher.supervisor.watchdog import NodeWatch, Watchdog, end_hung, wait_watching
from trainer.contract import EXIT_CHECKPOINTED, EXIT_FAILED, HEARTBEAT_DIR_ENV, read_stop_marker

# The torchrun agent of this process, for checkpoint(): module state, so the task itself stays picklable.
_agent: subprocess.Popen[bytes] | None = None


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
        if self.standalone:
            return self._run(node, sys.stdout.buffer)
        with open(Path(self.job_dir) / f"node-{node}.log", "ab") as log:  # appended to across requeues
            return self._run(node, log)

    def _run(self, node: int, log: BinaryIO) -> int:
        started = time.time()
        env = os.environ | self.env  # the node command changes to the workdir itself
        watchdog = None
        if self.watch is not None:
            beats = heartbeat_dir(Path(self.job_dir), node)
            env[HEARTBEAT_DIR_ENV] = str(beats)
            watchdog = self.watch.watchdog(node, socket.gethostname(), beats)
        if self.image is None:
            return self._watch(node, self.argv, env, watchdog, started, log)
        # The container's monitor (conmon) re-parents to this task, not to init: under
        # proctrack/linuxproc (the process tree), SLURM's signals and its final SIGKILL reach it and
        # the ranks, host processes (--pid=host). Under proctrack/cgroup podman's own cgroup escapes
        # that: then only this task's removal of the container ends it.
        procs.become_subreaper()
        container = self.image.container(f"gptlaunch-{os.environ.get('SLURM_JOB_ID', 'job')}-node{node}")
        container.remove()  # one a killed earlier run of this job left
        # What the node command and the ranks read: the plan's variables, SLURM's (with the GPUs it
        # gave this job), ours, the heartbeat dir.
        ours = ("SLURM_", "GPTLAUNCH_", "CUDA_VISIBLE_DEVICES")
        names = [*self.env, *(k for k in env if k.startswith(ours)), HEARTBEAT_DIR_ENV]
        try:
            try:
                argv = self.image.argv(container, self.argv, names)
            except OSError as e:  # a mount that cannot be made
                log.write(f"task: cannot start the node's container: {e}\n".encode())
                raise SystemExit(EXIT_FAILED) from None
            return self._watch(node, argv, env, watchdog, started, log)
        finally:
            container.remove()

    def _watch(
        self,
        node: int,
        argv: list[str],
        env: dict[str, str],
        watchdog: Watchdog | None,
        started: float,
        log: BinaryIO,
    ) -> int:
        global _agent
        log.flush()
        _agent = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        code, hang = wait_watching(_agent, watchdog)
        if hang is not None:
            self._hung(node, _agent, hang, log)
        if code == 0:
            return 0
        if read_stop_marker(Path(self.run_dir), started) is not None:  # stopped on request, checkpointed
            if node == 0:
                raise SystemExit(EXIT_CHECKPOINTED)
            return 0
        # Which node failed first, even when no rank could write an error file (a crash, a kill).
        reports.append(Path(self.job_dir), reports.Failed(node=node, exit_code=code))
        raise SystemExit(EXIT_FAILED)

    def _hung(self, node: int, agent: subprocess.Popen[bytes], hang: HangReport, log: BinaryIO) -> NoReturn:
        """After this node's stacks are taken: its report in the shared job record; its ranks kept
        until every node's report is there (a bound), then ended (srun then ends the other tasks).
        Standalone, the task then says what they found."""
        nnodes = int(os.environ.get("SLURM_NNODES", "1"))
        job_dir = Path(self.job_dir)
        found = [hang]

        def report(hang: HangReport) -> None:
            reports.append(job_dir, reports.Hang(node=node, hang=hang, time=hang.time))
            os.write(log.fileno(), f"{hang.summary()}\n".encode())

        def everyone() -> bool:
            nonlocal found
            found = reports.hangs(job_dir, since=hang.time - HANG_REPORTS_S) or found
            return len(found) >= nnodes

        end_hung(agent, hang, report, everyone, HANG_REPORTS_S)
        if self.standalone:
            merged = merge(found)
            stacks = write_stacks(job_dir, merged)
            os.write(log.fileno(), f"task: {hang_message(merged, stacks)}\n".encode())
        raise SystemExit(EXIT_HANG)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's hook on SIGUSR2 (node 0): the ranks got the signal too and are saving a checkpoint;
        wait for them to exit (the requeue would kill them), then requeue this same task."""
        from submitit.helpers import DelayedSubmission

        if _agent is not None:
            # Past the timeout, requeue anyway: the last periodic checkpoint is what resumes.
            _wait_exited(_agent.pid, timeout_s=self.grace_s + 30)
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
