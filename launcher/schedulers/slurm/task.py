"""What submitit runs on each node of a SLURM job: that node's command, its output in the job record.

submitit pickles a ``NodeTask`` (the Plan's command, environment and paths: no secret, they come from the
environment SLURM exports) and calls it once per node, one task per node. On SLURM's warning signal
(SIGUSR2) submitit calls ``checkpoint()`` on node 0's task: it waits until the ranks have saved their
checkpoint and exited, then hands submitit the same task to requeue; the requeued run resumes from the
run directory's checkpoint.

Exit status of a task, which srun (``--kill-on-bad-exit=1``) and the job's SLURM state reflect:
0 when the node's ranks finished; 75 on node 0 when the ranks stopped on request with a checkpoint
(other nodes exit 0 then, so that srun does not kill node 0 while it requeues); 1 when the node failed;
124 when its hang watchdog found the ranks stalled (their stacks and the report are in the node log).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from launcher.job.hang import EXIT_HANG, HangReport, heartbeat_dir, read_reports
from launcher.supervisor.watchdog import NodeWatch, end_hung, wait_watching
from trainer.contract import (
    EXIT_CHECKPOINTED,
    EXIT_FAILED,
    HEARTBEAT_DIR_ENV,
    atomic_write_text,
    read_stop_marker,
)

HANG_REPORTS_S = 30.0  # after this node's hang report, how long the others get to write theirs

# The torchrun agent of this process, for checkpoint(): module state, so the task itself stays picklable.
_agent: subprocess.Popen[bytes] | None = None


def failed_name(node: int) -> str:
    """The file in the job record where node ``node``'s task records its failure: {exit_code, time}."""
    return f"node-{node}.failed.json"


@dataclass(frozen=True)
class NodeTask:
    argv: list[str]
    env: dict[str, str]
    job_dir: str
    run_dir: str
    grace_s: float  # seconds the ranks get to checkpoint after a stop signal
    watch: NodeWatch | None = None  # the hang watchdog of this node's ranks (None: off)

    def __call__(self) -> int:
        global _agent
        node = int(os.environ.get("SLURM_NODEID", "0"))
        started = time.time()
        log_path = Path(self.job_dir) / f"node-{node}.log"  # appended to across requeues
        env = os.environ | self.env  # the node command changes to the workdir itself
        watchdog = None
        if self.watch is not None:
            beats = heartbeat_dir(Path(self.job_dir), node)
            env[HEARTBEAT_DIR_ENV] = str(beats)
            watchdog = self.watch.watchdog(node, socket.gethostname(), beats)
        with open(log_path, "ab") as log:
            _agent = subprocess.Popen(
                self.argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        code, hang = wait_watching(_agent, watchdog)
        if hang is not None:
            self._hung(_agent, hang, log_path)
        if code == 0:
            return 0
        if read_stop_marker(Path(self.run_dir), started) is not None:  # stopped on request, checkpointed
            if node == 0:
                raise SystemExit(EXIT_CHECKPOINTED)
            return 0
        # Which node failed first, even when no rank could write an error file (a crash, a kill).
        failed = {"exit_code": code, "time": time.time()}
        atomic_write_text(Path(self.job_dir) / failed_name(node), json.dumps(failed))
        raise SystemExit(EXIT_FAILED)

    def _hung(self, agent: subprocess.Popen[bytes], hang: HangReport, log_path: Path) -> NoReturn:
        """After this node's stacks are taken: its report in its log, its ranks ended. The other nodes'
        watchdogs report too: srun ends every task once one fails, so wait (a bound) for their reports
        in the shared job record before failing."""
        with open(log_path, "ab") as log:
            end_hung(agent, hang, log.write)
        nnodes = int(os.environ.get("SLURM_NNODES", "1"))
        logs = [Path(self.job_dir) / f"node-{k}.log" for k in range(nnodes)]
        deadline = time.monotonic() + HANG_REPORTS_S
        while (
            len(read_reports(logs, since=hang.time - HANG_REPORTS_S)) < nnodes and time.monotonic() < deadline
        ):
            time.sleep(0.5)
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
