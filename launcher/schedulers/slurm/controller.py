"""A SLURM job run by the one controller (``--slurm-controller``): ``launcher supervise --job-dir DIR``,
the program that runs local, SSH and compose jobs, runs inside the allocation, on its first node, in
the batch step. It starts each node's agent as a job step (``launcher.schedulers.slurm.transport``),
follows the attempts, retries onto the allocation's spare nodes, requeues the job when none is left
or when SLURM warns of a time limit or a preemption, and records the job's end itself.

submitit stays the way into SLURM: it renders and submits the batch script, reads the job's states
from ``sacct``, and runs ``Controller`` once per allocation, in the batch step (``use_srun=False``: one
task, where the steps are started from). ``Controller`` execs ``launcher supervise`` in its place. Not
submitit's ``checkpoint()`` for requeues: its handler of SLURM's signal requeues the job as soon as
``checkpoint()`` returns, from inside the handler (``submitit/core/job_environment.py``,
``SignalHandler.checkpoint_and_try_requeue``), while the controller must first follow every rank to
its checkpoint; and SLURM's warning before the time limit (``--signal=USR2@T``, as submitit renders
it in ``submitit/slurm/slurm.py`` ``_make_sbatch_string``) is sent to the job's steps, not to the batch
step that submitit's callable runs in. The ranks get it, checkpoint and stop; the controller sees
that and requeues the job (``SrunAgents.requeue``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.agent.transport import agent_argv
from launcher.job.hang import heartbeat_dir
from launcher.job.plan import NodeCommand, Plan
from launcher.job.record import JobRecord, agent_dir
from launcher.job.spec import JobSpec
from launcher.job.torchrun import node_agents
from launcher.schedulers.slurm.transport import SrunAgents, allocation_hosts, placed
from launcher.supervisor.supervisor import SUPERVISE

ALLOCATED = "(allocated by SLURM)"  # a node's host until the controller places it


@dataclass(frozen=True)
class Controller:
    """What submitit runs once per allocation: ``launcher supervise --job-dir job_dir`` in its place."""

    job_dir: str

    def __call__(self) -> None:
        argv = [sys.executable, *SUPERVISE, "--job-dir", self.job_dir]
        os.execv(argv[0], argv)  # submitit's signal handlers go with its process


def node_commands(
    spec: JobSpec, workdir: str, job_id: str, job_dir: Path, worker: list[str], env: dict[str, str]
) -> list[NodeCommand]:
    """Each node's agent (``launcher.agent run``) running its torchrun, whose rank is known now (a
    static rendezvous at node 0) and whose rendezvous host and port are filled in on the node
    (``launcher.job.node``: ``{{first_host}}``, set by the controller, and ``{{rdzv_port}}``)."""
    rdzv = spec.rendezvous
    endpoint = f"{rdzv.endpoint or '{{first_host}}'}:{rdzv.port or '{{rdzv_port}}'}"
    torchruns = node_agents(spec, endpoint=endpoint, job_id=job_id, job_dir=job_dir, worker=worker)
    entry = [spec.python, "-m", "launcher.job.node", "--workdir", workdir, "--"]
    beats, state = [heartbeat_dir(job_dir, k) for k in range(spec.nnodes)], agent_dir(job_dir)
    return [
        NodeCommand(
            host=ALLOCATED,
            argv=agent_argv(
                spec.python, spec, job_id, k, [*entry, *run], heartbeat_dir=beats[k], state_dir=state
            ),
            env=env,
        )
        for k, run in enumerate(torchruns)
    ]


def transport(plan: Plan, record: JobRecord) -> SrunAgents:
    """The controller's transport in this allocation, its nodes on the allocation's first hosts (the
    rest are spares), recorded in the job's Plan."""
    hosts = allocation_hosts()
    here = placed(plan, hosts[: plan.nnodes])
    record.write_plan(here)
    return SrunAgents(here, record, hosts, since=time.time())
