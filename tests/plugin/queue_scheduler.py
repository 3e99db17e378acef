"""A minimal scheduler defined outside ``launcher/``: registered through an entry point by the test
(``tests/unit/test_scheduler_plugin.py``) as a package of its own would register it, to prove that a
scheduler is one folder plus one registry line."""

from __future__ import annotations

from pathlib import Path

from launcher.job.plan import Facts, NodeCommand, Plan, build_plan, workdir_of
from launcher.job.spec import JobSpec
from launcher.job.torchrun import agent_env, node_agents, with_run_dir
from tests.plugin.queue_options import QueueOptions


class QueueFacts(Facts):
    queue_name: str


class QueueScheduler:
    name = "queue"
    files_here = False
    queued = True

    def resolve(self, spec: JobSpec) -> QueueFacts:
        assert isinstance(spec.scheduler, QueueOptions)
        return QueueFacts(workdir=workdir_of(spec, files_here=False), queue_name=spec.scheduler.queue_name)

    def render(self, spec: JobSpec, facts: QueueFacts, job_id: str, job_dir: Path) -> Plan:
        endpoint = "queue-node-0:29500"
        args, run_dir = with_run_dir(spec.trainer_args, job_dir / "run")
        env = agent_env(spec, job_id, 1)
        agents = node_agents(spec, endpoint=endpoint, job_id=job_id, job_dir=job_dir, trainer_args=args)
        nodes = [NodeCommand(host=f"{facts.queue_name}-{k}", argv=a, env=env) for k, a in enumerate(agents)]
        return build_plan(self.name, spec, facts, job_id, endpoint=endpoint, run_dir=run_dir, nodes=nodes)
