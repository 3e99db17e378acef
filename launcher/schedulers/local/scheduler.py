"""The local scheduler: ``nnodes`` emulated nodes on this machine, one torchrun agent per node.

Agents meet at a c10d rendezvous on 127.0.0.1 at a free port and share the machine: the cores
(OMP_NUM_THREADS = cores / world_size) and, where there are GPUs, the devices (each node sees its
own slice through CUDA_VISIBLE_DEVICES). A supervisor process (``local_supervisor``), forked at
submit in its own session, starts the agents and follows them to the end; the job record is all any
other command needs to find it again.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher.supervisor import procs
from launcher.job.failures import stop_outcome
from launcher.job.record import (
    JobError,
    JobRecord,
    JobState,
    JobStatus,
    Outcome,
    node_log_name,
)
from launcher.job.options import LocalOptions
from launcher.job.plan import NodePlan, Plan
from launcher.schedulers.base import node_logs, wait_terminal
from launcher.supervisor.supervisor import (
    FAIL_FAST_GRACE_S,
    LocalAgents,
    SupervisorHandle,
    start_supervisor,
)
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import agent_env, node_agents, with_run_dir
from trainer.contract import EXIT_FAILED, read_stop_marker


def free_port(host: str) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it). Raises SpecError when
    ``host`` is not an address of this machine."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    except OSError as e:
        raise SpecError(
            f"rendezvous.endpoint (--rdzv-endpoint) {host!r} is not an address of this machine ({e}): "
            "the local scheduler needs a local address such as 127.0.0.1"
        ) from None


def visible_gpus(env: dict[str, str]) -> list[str]:
    """Ids of the GPUs to share out: CUDA_VISIBLE_DEVICES's list when set (in ``env``), else one per
    GPU the NVIDIA driver lists in /proc (no torch import: the launcher must start fast)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    driver = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(driver.iterdir())))] if driver.is_dir() else []


def _positive_int(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise SpecError(
            f"{name}={value!r} (from --env or this shell) is not a positive integer: fix or unset it"
        )
    return int(value)


class LocalScheduler:
    name = "local"
    files_here = True
    queued = False

    def preflight(self, spec: JobSpec, plan: Plan) -> None:
        """Nothing to try before a job here."""

    def resolve(self, spec: JobSpec) -> dict[str, Any]:
        """Absolute workdir, free rendezvous port, thread and GPU shares. Raises SpecError for what
        cannot run here (no such interpreter or directory, too few GPUs, a non-local endpoint)."""
        if shutil.which(spec.python) is None:
            raise SpecError(
                f"python (--python) {spec.python!r} is not an executable: pass an interpreter path"
            )
        workdir = workdir_of(spec)
        host = spec.rendezvous.endpoint or "127.0.0.1"
        user_env = os.environ | spec.network.env  # --env wins over the shell
        threads = spec.omp_num_threads or _positive_int(user_env.get("OMP_NUM_THREADS"), "OMP_NUM_THREADS")
        assert isinstance(spec.scheduler, LocalOptions)
        gpus = spec.scheduler.gpus if spec.scheduler.gpus is not None else visible_gpus(user_env)
        if gpus and spec.world_size > len(gpus):
            raise SpecError(
                f"{spec.nnodes} node(s) × {spec.nproc_per_node} process(es) need {spec.world_size} GPUs, "
                f"{len(gpus)} are available: lower --nodes/--gpus-per-node, or set scheduler.gpus: [] "
                "(CPU only)"
            )
        return {
            "workdir": str(workdir),
            "rdzv_host": host,
            "rdzv_port": spec.rendezvous.port or free_port(host),
            "omp_num_threads": int(threads or max(1, len(os.sched_getaffinity(0)) // spec.world_size)),
            "gpus": gpus,
        }

    def render(self, spec: JobSpec, facts: dict[str, Any], job_id: str, job_dir: Path) -> Plan:
        endpoint = f"{facts['rdzv_host']}:{facts['rdzv_port']}"
        args, run_dir = with_run_dir(spec.trainer_args, job_dir / "run")
        env = agent_env(spec, job_id, facts["omp_num_threads"])
        nodes = []
        agents = node_agents(spec, endpoint=endpoint, job_id=job_id, job_dir=job_dir, trainer_args=args)
        for k, argv in enumerate(agents):
            node_env = dict(env)
            if facts["gpus"]:  # node k's GPUs, so every node's LOCAL_RANK 0 is a different device
                first = k * spec.nproc_per_node
                node_env["CUDA_VISIBLE_DEVICES"] = ",".join(
                    facts["gpus"][first : first + spec.nproc_per_node]
                )
            nodes.append(
                NodePlan(
                    node_rank=k,
                    host="localhost",
                    argv=argv,
                    env=node_env,
                    cwd=facts["workdir"],
                    log=node_log_name(k),
                )
            )
        return Plan(
            job_id=job_id,
            scheduler=self.name,
            nnodes=spec.nnodes,
            nproc_per_node=spec.nproc_per_node,
            rdzv_endpoint=endpoint,
            run_dir=str(Path(facts["workdir"]) / run_dir),  # the trainer resolves a relative one in workdir
            nodes=nodes,
            facts=facts,
        )

    def submit(self, plan: Plan, record: JobRecord, *, detach: bool) -> SupervisorHandle:
        return start_supervisor(plan, record, LocalAgents(), detach=detach)

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
        remaining = self._remaining(record) if handle else ""
        if remaining:
            return status.model_copy(update={"message": f"its supervisor is gone; {remaining}"})
        since = status.started_at or status.created_at
        if read_stop_marker(Path(record.plan().run_dir), since) is not None:
            return _record_end(record, status, stop_outcome(record.plan(), since))
        message = "the process following the job died before recording its end; nothing of it runs"
        return _record_end(
            record, status, Outcome(state=JobState.LOST, exit_code=EXIT_FAILED, message=message)
        )

    def logs(self, record: JobRecord, node: int | None, follow: bool) -> Iterator[str]:
        return node_logs(self, record, node, follow)

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
            final = wait_terminal(self, record, grace + 3 * FAIL_FAST_GRACE_S, poll_s=0.1)
            if final is not None:
                return final
        elif not wait:  # nothing to ask: the sweep below would block
            return status
        # Nothing follows the job (or its supervisor hangs): stop what is left ourselves.
        asked = time.time()
        self._sweep(record, record.spec().grace_period_s)
        if handle is not None and procs.alive(handle.supervisor):
            procs.terminate(procs.processes([handle.supervisor.pid]), FAIL_FAST_GRACE_S)
        return record.finish(stop_outcome(record.plan(), asked))

    def _remaining(self, record: JobRecord) -> str:
        """What of the job still runs without its supervisor ("" for nothing)."""
        found = procs.job_processes(record.job_id)
        return f"{len(found)} process(es) of the job are still stopping" if found else ""

    def _sweep(self, record: JobRecord, grace_s: float) -> None:
        """Stop every process of the job: SIGTERM, SIGKILL after ``grace_s`` seconds."""
        procs.sweep(record.job_id, grace_s)


def workdir_of(spec: JobSpec) -> Path:
    """The job's absolute working directory. Raises SpecError when it is not a directory."""
    workdir = (spec.workdir or Path.cwd()).absolute()
    if not workdir.is_dir():
        raise SpecError(f"workdir (--workdir) {workdir} is not a directory")
    return workdir


def _record_end(record: JobRecord, status: JobStatus, outcome: Outcome) -> JobStatus:
    """Record an end that a reader found out; on a read-only job dir, just report it."""
    try:
        return record.finish(outcome)
    except OSError:
        return status.model_copy(update=dict(outcome))
