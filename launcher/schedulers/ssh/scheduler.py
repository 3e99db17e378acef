"""The SSH scheduler: one torchrun agent per host, started through the system OpenSSH client.

Before anything starts, ``launcher.schedulers.ssh.hosts`` probes every host at once and refuses a launch whose hosts
differ in versions that must match (exit 3, with the diff), resolves master_addr on every host, picks
each host's network interface towards it, and proves the rendezvous port reachable. A supervisor on
this machine (the local scheduler's, with ``SshAgents``) then runs one ``ssh host ...`` per node,
whose output is the node's log here; on each host, ``launcher.schedulers.ssh.hostagent`` runs the torchrun agent in
a process tree it tracks, so that a dropped connection neither kills nor orphans the node, and
``hostagent signal`` stops it (the ranks checkpoint) or ends it (TERM, then KILL).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from launcher.supervisor import procs

from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.hosts import HostPlan, collective, plan_hosts, ssh_settings
from launcher.preflight.collective import format_table
from launcher.job.record import JobRecord, node_log_name
from launcher.job.options import SshOptions
from launcher.job.plan import NodePlan, Plan
from launcher.schedulers.local.scheduler import LocalScheduler
from launcher.supervisor.supervisor import SupervisorHandle, start_client, start_supervisor
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import agent_env, node_agents, with_run_dir

SIGNAL_TIMEOUT_S = 30.0  # for `hostagent signal/status` over an established connection


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class SshScheduler(LocalScheduler):
    name = "ssh"
    files_here = False  # the hosts may not share this machine's files
    queued = False

    def resolve(self, spec: JobSpec) -> dict[str, Any]:
        """Every check of ``launcher.schedulers.ssh.hosts.plan_hosts`` (probes the hosts; starts nothing). Raises
        SpecError, or ParityError (exit 3) for hosts whose versions differ."""
        opts = _options(spec)
        if spec.rendezvous.endpoint is not None:
            raise SpecError(
                "rendezvous.endpoint (--rdzv-endpoint) is the first host for the SSH scheduler: "
                "put the host you want first in --hosts / the hostfile"
            )
        hosts = plan_hosts(
            opts, spec.nnodes, spec.nproc_per_node, spec.python, spec.rendezvous.port, warn=_say
        )
        return {
            "workdir": str((spec.workdir or Path.cwd()).absolute()),
            "hosts": hosts.hosts,
            "master_addr": hosts.master_addr,
            "rdzv_port": hosts.port,
            "ifnames": hosts.ifnames,
            "omp_num_threads": spec.omp_num_threads,
        }

    def preflight(self, spec: JobSpec, plan: Plan) -> None:
        """With ``--preflight``: a short all_reduce across the hosts with the job's backend settings
        and interfaces (``launcher.schedulers.ssh.hosts.collective``); raises SpecError when it cannot form."""
        opts = _options(spec)
        if opts.preflight:
            hosts = _host_plan(plan.facts)
            _say(f"launcher: preflight: all_reduce across {', '.join(hosts.hosts)} ...")
            _say(format_table(collective(opts, hosts, spec.python, spec.network.as_env())))

    def render(self, spec: JobSpec, facts: dict[str, Any], job_id: str, job_dir: Path) -> Plan:
        endpoint = f"{facts['master_addr']}:{facts['rdzv_port']}"
        args, run_dir = with_run_dir(spec.trainer_args, job_dir / "run")
        env = agent_env(spec, job_id, facts["omp_num_threads"])
        hosts = _host_plan(facts)
        nodes = []
        agents = node_agents(spec, endpoint=endpoint, job_id=job_id, job_dir=job_dir, trainer_args=args)
        for k, (host, agent) in enumerate(zip(facts["hosts"], agents, strict=True)):
            wrapper = [
                spec.python,
                "-m",
                "launcher.schedulers.ssh.hostagent",
                "run",
                "--job",
                job_id,
                "--node",
                str(k),
                "--",
            ]
            nodes.append(
                NodePlan(
                    node_rank=k,
                    host=host,
                    argv=[*wrapper, *agent],
                    env=env | hosts.env(host, env),
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
            run_dir=str(Path(facts["workdir"]) / run_dir),
            nodes=nodes,
            facts=facts,
        )

    def submit(self, plan: Plan, record: JobRecord, *, detach: bool) -> SupervisorHandle:
        spec = record.spec()
        agents = SshAgents(plan, ssh_settings(_options(spec)), spec.python, spec.secrets_here())
        return start_supervisor(plan, record, agents, detach=detach)

    def _remaining(self, record: JobRecord) -> str:
        running = _hosts_running(record)
        return f"still running on {', '.join(running)} (`launcher cancel` stops it)" if running else ""

    def _sweep(self, record: JobRecord, grace_s: float) -> None:
        spec = record.spec()
        SshAgents(record.plan(), ssh_settings(_options(spec)), spec.python, {}).kill(record.job_id, grace_s)


def _host_plan(facts: dict[str, Any]) -> HostPlan:
    return HostPlan(facts["hosts"], facts["master_addr"], facts["rdzv_port"], facts["ifnames"], {})


def _options(spec: JobSpec) -> SshOptions:
    assert isinstance(spec.scheduler, SshOptions)
    return spec.scheduler


def _hostagent(python: str, action: str, job_id: str, node: int, *extra: str) -> str:
    argv = [python, "-m", "launcher.schedulers.ssh.hostagent", action, "--job", job_id, "--node", str(node), *extra]
    return f"cd / && {shlex.join(argv)}"


def _hosts_running(record: JobRecord) -> list[str]:
    """The hosts where a node of the job still runs, all asked at once. A host that cannot be reached
    counts as running: nothing says its node is gone."""
    spec, nodes = record.spec(), {n.host: n.node_rank for n in record.plan().nodes}

    def command(host: str) -> str:
        return _hostagent(spec.python, "status", record.job_id, nodes[host])

    running = []
    for result in ssh.fan_out(ssh_settings(_options(spec)), list(nodes), command, SIGNAL_TIMEOUT_S):
        try:
            if json.loads(result.stdout.strip().splitlines()[-1])["running"]:
                running.append(result.host)
        except (ValueError, IndexError, KeyError):
            if result.returncode is None or result.returncode == ssh.SSH_FAILED:
                running.append(result.host)
    return running


class SshAgents:
    """The supervisor's agents for SSH: one ``ssh host hostagent run ...`` client per node."""

    def __init__(self, plan: Plan, settings: ssh.SshSettings, python: str, secrets: dict[str, str]) -> None:
        self.plan, self.settings, self.python, self.secrets = plan, settings, python, secrets

    def start(self, node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
        # The secrets travel inside the encrypted channel, read once by the hostagent.
        argv = self.settings.argv(node.host, node.shell_command())
        return start_client(argv, record.dir / node.log, self.secrets, keep_stdin=False)

    def stop(self, agents: list[subprocess.Popen[bytes]]) -> None:
        nodes = [n for n, a in zip(self.plan.nodes, agents, strict=False) if a.poll() is None]
        self._signal(nodes, "TERM", 0.0)

    def kill(self, job_id: str, grace_s: float) -> None:
        self._signal(self.plan.nodes, "KILL", grace_s)
        procs.terminate(psutil.Process().children(recursive=True), grace_s)  # ssh clients, masters

    def _signal(self, nodes: list[NodePlan], sig: str, grace_s: float) -> None:
        by_host = {n.host: n for n in nodes}
        extra = ("--signal", sig, "--grace-s", f"{grace_s:g}")

        def command(host: str) -> str:
            return _hostagent(self.python, "signal", self.plan.job_id, by_host[host].node_rank, *extra)

        for result in ssh.fan_out(self.settings, list(by_host), command, SIGNAL_TIMEOUT_S + grace_s):
            if not result.ok:
                _say(f"launcher: could not signal the job on {result.error()}")
