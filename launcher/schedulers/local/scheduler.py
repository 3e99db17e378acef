"""The local scheduler: ``nnodes`` emulated nodes on this machine, one torchrun agent per node, sharing
its cores and GPUs (``docs/schedulers/local.md``); a supervisor (``launcher.supervisor``), forked at
submit in its own session, starts each node's agent as a child process and follows them to the end."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from launcher.agent.transport import ChannelAgents, agent_argv
from launcher.job.hang import heartbeat_dir
from launcher.job.plan import Facts, NodeCommand, Plan, build_plan, workdir_of
from launcher.job.record import JobRecord, agent_dir
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import (
    agent_env,
    check_warm_program,
    node_agents,
    warm_worker,
    warm_workers,
    worker_argv,
)
from launcher.schedulers.local.options import LocalOptions
from launcher.schedulers.local.warm import WarmAgents, zygote_socket
from launcher.supervisor.scheduler import SupervisedScheduler
from launcher.supervisor.transport import Transport


class LocalFacts(Facts):
    rdzv_host: str
    rdzv_port: int
    omp_num_threads: int
    gpus: list[str]  # ids shared out between the nodes; [] for CPU processes
    agent_python: str  # the node agents' interpreter: the launcher's (--python's need not have it)


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


class LocalScheduler(SupervisedScheduler):
    name = "local"
    files_here = True

    def resolve(self, spec: JobSpec) -> LocalFacts:
        """Absolute workdir, free rendezvous port, thread and GPU shares. Raises SpecError for what
        cannot run here (no such interpreter or directory, too few GPUs, a non-local endpoint)."""
        if shutil.which(spec.python) is None:
            raise SpecError(
                f"python (--python) {spec.python!r} is not an executable: pass an interpreter path"
            )
        workdir = workdir_of(spec, files_here=True)
        host = spec.rendezvous.endpoint or "127.0.0.1"
        user_env = os.environ | spec.network.env  # --env wins over the shell
        threads = spec.omp_num_threads or _positive_int(user_env.get("OMP_NUM_THREADS"), "OMP_NUM_THREADS")
        opts = spec.options(LocalOptions)
        check_warm_program(spec)
        gpus = opts.gpus if opts.gpus is not None else visible_gpus(user_env)
        if gpus and spec.world_size > len(gpus):
            raise SpecError(
                f"{spec.nnodes} node(s) × {spec.nproc_per_node} process(es) need {spec.world_size} GPUs, "
                f"{len(gpus)} are available: lower --nodes/--gpus-per-node, or set scheduler.gpus: [] "
                "(CPU only)"
            )
        return LocalFacts(
            workdir=workdir,
            rdzv_host=host,
            rdzv_port=spec.rendezvous.port or free_port(host),
            omp_num_threads=int(threads or max(1, len(os.sched_getaffinity(0)) // spec.world_size)),
            gpus=gpus,
            agent_python=sys.executable,
        )

    def render(self, spec: JobSpec, facts: LocalFacts, job_id: str, job_dir: Path) -> Plan:
        endpoint = f"{facts.rdzv_host}:{facts.rdzv_port}"
        worker, run_dir = worker_argv(spec, job_dir / "run")
        if warm_workers(spec):
            worker = warm_worker(worker, str(zygote_socket(job_id)))
        env = agent_env(spec, job_id, facts.omp_num_threads, run_dir)
        nodes = []
        agents = node_agents(spec, endpoint=endpoint, job_id=job_id, job_dir=job_dir, worker=worker)
        for k, argv in enumerate(agents):
            node_env = dict(env)
            if facts.gpus:  # node k's GPUs, so every node's LOCAL_RANK 0 is a different device
                first = k * spec.nproc_per_node
                node_env["CUDA_VISIBLE_DEVICES"] = ",".join(facts.gpus[first : first + spec.nproc_per_node])
            agent = agent_argv(
                facts.agent_python, spec, job_id, k, argv,
                heartbeat_dir=heartbeat_dir(job_dir, k), state_dir=agent_dir(job_dir),
            )  # fmt: skip
            nodes.append(NodeCommand(host="localhost", argv=agent, env=node_env))
        return build_plan(self.name, spec, facts, job_id, endpoint=endpoint, run_dir=run_dir, nodes=nodes)

    def transport(self, plan: Plan, record: JobRecord) -> Transport:
        spec = record.spec()
        if warm_workers(spec):
            return WarmAgents(spec.secrets_here(), spec.python, plan.job_id)
        return ChannelAgents(spec.secrets_here())
