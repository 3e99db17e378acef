"""The local scheduler: ``nnodes`` emulated nodes on this machine, one torchrun agent per node.

Agents meet at a c10d rendezvous on 127.0.0.1 at a free port and share the cores
(OMP_NUM_THREADS = cores / world_size). The job runs attached: output streams to the terminal,
prefixed by node and rank, and into ``node-<k>.log``. If any agent fails, the others are stopped at
once (fail fast); Ctrl-C or ``launcher cancel`` asks every rank to checkpoint and exit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from launcher import procs
from launcher.failures import root_cause
from launcher.jobs import FINAL_STATES, JobRecord, JobStatus
from launcher.logs import LogFollower
from launcher.plan import NodePlan, Plan
from launcher.spec import JobSpec
from launcher.torchrun import LOG_LINE_PREFIX, torchrun_argv, with_run_dir
from trainer.checkpoint import list_checkpoints

EXIT_CHECKPOINTED = 75
EXIT_INTERRUPTED = 130
FAIL_FAST_GRACE_S = 5.0  # a failed job cannot checkpoint (a peer is gone): stop the rest quickly


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalScheduler:
    name = "local"

    def resolve(self, spec: JobSpec) -> JobSpec:
        rdzv = spec.rendezvous
        updates: dict[str, Any] = {}
        if rdzv.endpoint is None or rdzv.port is None:
            endpoint = rdzv.endpoint or "127.0.0.1"
            updates["rendezvous"] = rdzv.model_copy(
                update={"endpoint": endpoint, "port": rdzv.port or free_port(endpoint)}
            )
        if spec.omp_num_threads is None:
            updates["omp_num_threads"] = max(1, (os.cpu_count() or 1) // spec.world_size)
        return spec.model_copy(update=updates)

    def render(self, spec: JobSpec, job_id: str, job_dir: Path) -> Plan:
        rdzv = spec.rendezvous
        endpoint = f"{rdzv.endpoint or '127.0.0.1'}:{rdzv.port or 29500}"
        args, run_dir = with_run_dir(spec.trainer_args, job_dir / "run")
        env = {"PYTHONUNBUFFERED": "1", procs.JOB_ENV: job_id, **spec.network.as_env()}
        if spec.omp_num_threads:
            env["OMP_NUM_THREADS"] = str(spec.omp_num_threads)
        nodes = []
        for k in range(spec.nnodes):
            argv = torchrun_argv(
                spec,
                node_rank=k,
                endpoint=endpoint,
                rdzv_id=rdzv.id or job_id,
                log_dir=str(job_dir / "torchelastic" / f"node-{k}"),
                trainer_args=args,
            )
            node_env = env | {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LOG_LINE_PREFIX}
            nodes.append(
                NodePlan(
                    node_rank=k,
                    host="localhost",
                    argv=argv,
                    env=node_env,
                    cwd=str(spec.workdir),
                    log=f"node-{k}.log",
                )
            )
        return Plan(
            job_id=job_id,
            scheduler=self.name,
            nnodes=spec.nnodes,
            nproc_per_node=spec.nproc_per_node,
            rdzv_endpoint=endpoint,
            run_dir=str(run_dir),
            nodes=nodes,
        )

    def launch(self, plan: Plan, record: JobRecord) -> JobStatus:
        procs.become_subreaper()
        grace = record.spec().grace_period_s
        stop = _StopOnSignal()
        before = {p.name for p in list_checkpoints(Path(plan.run_dir))}
        agents = [_start(node, record) for node in plan.nodes]
        status = JobStatus(
            launcher_pid=os.getpid(),
            launcher_started=psutil.Process().create_time(),
            node_pids=[a.pid for a in agents],
            started_at=time.time(),
        )
        record.write_status(status)
        follower = LogFollower([(f"node{n.node_rank}", record.dir / n.log) for n in plan.nodes], sys.stdout)
        follower.start()
        try:
            final = self._supervise(agents, stop, grace, plan, record, before)
        finally:
            stop.restore()
            procs.terminate(_descendants(), FAIL_FAST_GRACE_S)
            procs.sweep(plan.job_id)
            follower.stop()
        outcome = {name: getattr(final, name) for name in final.model_fields_set}
        final = status.model_copy(update=outcome | {"ended_at": time.time()})
        record.write_status(final)
        return final

    def _supervise(
        self,
        agents: list[subprocess.Popen[bytes]],
        stop: _StopOnSignal,
        grace: float,
        plan: Plan,
        record: JobRecord,
        before: set[str],
    ) -> JobStatus:
        stop_at: float | None = None
        while True:
            codes = [a.poll() for a in agents]
            if stop.requested and stop_at is None:
                stop_at = time.monotonic()
                procs.signal_all([psutil.Process(a.pid) for a in agents if a.poll() is None], signal.SIGTERM)
            if stop_at is not None:
                if all(c is not None for c in codes) or time.monotonic() - stop_at > grace:
                    return _stopped(plan, before)
            elif any(c not in (None, 0) for c in codes):
                # The first agent seen failing; the root cause comes from the ranks' error files.
                node = next(k for k, c in enumerate(codes) if c not in (None, 0))
                procs.terminate(_descendants(), FAIL_FAST_GRACE_S)
                failure = root_cause(record, plan.nnodes, node, codes[node])
                return JobStatus(state="failed", exit_code=1, failure=failure, message=failure.summary())
            elif all(c == 0 for c in codes):
                return JobStatus(state="succeeded", exit_code=0)
            time.sleep(0.1)

    def cancel(self, record: JobRecord, grace_s: float) -> JobStatus:
        status = record.status() or JobStatus()
        if status.state in FINAL_STATES:
            return status
        launcher = _alive(status.launcher_pid, status.launcher_started)
        if launcher is not None:
            # The launcher owns the job: it relays SIGTERM, waits for checkpoints, records the end.
            launcher.send_signal(signal.SIGTERM)
            status = _wait_final(record, timeout_s=grace_s + 3 * FAIL_FAST_GRACE_S) or status
        if status.state not in FINAL_STATES:  # the launcher is gone: stop what is left ourselves
            procs.sweep(record.job_id, grace_s)
            status = status.model_copy(
                update={
                    "state": "cancelled",
                    "exit_code": EXIT_INTERRUPTED,
                    "ended_at": time.time(),
                    "message": "cancelled",
                }
            )
            record.write_status(status)
        return status


def _start(node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
    with open(record.dir / node.log, "ab") as log:
        # A new session per node: Ctrl-C reaches only the launcher, which stops the job in order.
        return subprocess.Popen(
            node.argv,
            env=os.environ | node.env,
            cwd=node.cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_final(record: JobRecord, timeout_s: float) -> JobStatus | None:
    """The job's status once the launcher has recorded its end (None if it has not in ``timeout_s``).
    The status file, not the pid, tells: the launcher may linger as a zombie of its own parent."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = record.status()
        if status is not None and status.state in FINAL_STATES:
            return status
        time.sleep(0.2)
    return None


def _descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _alive(pid: int | None, started: float | None) -> psutil.Process | None:
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        return proc if started is None or abs(proc.create_time() - started) < 1e-3 else None
    except psutil.NoSuchProcess:
        return None


def _stopped(plan: Plan, before: set[str]) -> JobStatus:
    new = [p for p in list_checkpoints(Path(plan.run_dir)) if p.name not in before]
    if new:
        return JobStatus(
            state="checkpointed",
            exit_code=EXIT_CHECKPOINTED,
            message=f"stopped on request; checkpoint {new[-1]} saved: submit again with the same "
            f"--run-dir to resume",
        )
    return JobStatus(
        state="cancelled", exit_code=EXIT_INTERRUPTED, message="stopped on request, no checkpoint saved"
    )


class _StopOnSignal:
    """SIGINT (Ctrl-C) and SIGTERM (``launcher cancel``) ask the job to stop."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting; the finally block kills everything
        self.requested = True
        print(
            f"launcher: {signal.Signals(signum).name}: stopping the job (ranks checkpoint, then exit)",
            file=sys.stderr,
            flush=True,
        )

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
