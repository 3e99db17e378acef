"""A minimal scheduler defined outside ``launcher/``: registered through an entry point by the tests
(``tests/unit/test_scheduler_plugin.py``) as a package of its own would register it, to prove that a
scheduler is one folder plus one registry line. Its "queue" runs every node on this machine, each under
the node agent (``launcher.agent``): with nothing more, the job gets the hang watch with every rank's
stack, fail-fast, root cause and retries."""

from __future__ import annotations

import socket
from pathlib import Path

from launcher.agent.transport import ChannelAgents, agent_argv
from launcher.job.hang import heartbeat_dir
from launcher.job.plan import Facts, NodeCommand, Plan, build_plan, workdir_of
from launcher.job.record import JobRecord
from launcher.job.spec import JobSpec
from launcher.job.torchrun import agent_env, node_agents, worker_argv
from launcher.supervisor.scheduler import SupervisedScheduler
from tests.plugin.queue_options import QueueOptions


class QueueFacts(Facts):
    queue_name: str
    rdzv_port: int


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class QueueScheduler(SupervisedScheduler):
    name = "queue"
    files_here = True

    def resolve(self, spec: JobSpec) -> QueueFacts:
        assert isinstance(spec.scheduler, QueueOptions)
        return QueueFacts(
            workdir=workdir_of(spec, files_here=True),
            queue_name=spec.scheduler.queue_name,
            rdzv_port=spec.rendezvous.port or _free_port(),
        )

    def render(self, spec: JobSpec, facts: QueueFacts, job_id: str, job_dir: Path) -> Plan:
        endpoint = f"127.0.0.1:{facts.rdzv_port}"
        worker, run_dir = worker_argv(spec, job_dir / "run")
        env = agent_env(spec, job_id, 1, run_dir)
        agents = node_agents(spec, endpoint=endpoint, job_id=job_id, job_dir=job_dir, worker=worker)
        nodes = [
            NodeCommand(
                host=f"{facts.queue_name}-{k}",
                argv=agent_argv(spec.python, spec, job_id, k, a, heartbeat_dir=heartbeat_dir(job_dir, k)),
                env=env,
            )
            for k, a in enumerate(agents)
        ]
        return build_plan(self.name, spec, facts, job_id, endpoint=endpoint, run_dir=run_dir, nodes=nodes)

    def transport(self, plan: Plan, record: JobRecord) -> ChannelAgents:
        return ChannelAgents(record.spec().secrets_here())
