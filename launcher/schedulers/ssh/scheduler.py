"""The SSH scheduler: one torchrun agent per host, started through the system OpenSSH client.

Before anything starts, ``launcher.schedulers.ssh.hosts`` probes every host at once and refuses a launch
whose hosts differ in versions that must match (exit 3, with the diff), resolves master_addr on every
host, picks each host's network interface towards it, and proves the rendezvous port reachable. A
supervisor on this machine (``launcher.supervisor``, with ``SshAgents``) then runs one ``ssh host ...``
per node, whose output is the node's log here; on each host, the node agent (``launcher.agent``) runs
the torchrun agent in a process tree it tracks, so that a dropped connection neither kills nor orphans
the node, and ``launcher.agent signal`` stops it (the ranks checkpoint) or ends it (TERM, then KILL).
"""

from __future__ import annotations

import shlex
import subprocess
import threading
import time
from collections.abc import Collection
from pathlib import Path

import psutil
from pydantic import Field

from gptlaunch.contract import Beat, write_beat
from launcher.agent.transport import agent_argv, channel_reports
from launcher.image.reference import resolve as resolve_image
from launcher.image.runtime import ImageRun
from launcher.job.console import say
from launcher.job.hang import heartbeat_dir
from launcher.job.mounts import container_mounts
from launcher.job.plan import Facts, NodeCommand, NodePlan, Plan, build_plan, workdir_of
from launcher.job.record import JobRecord
from launcher.job.reports import NodeStatus
from launcher.job.retry import spares
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import IMAGE_PYTHON, agent_env, node_agents, worker_argv
from launcher.preflight.collective_report import format_table
from launcher.preflight.health import GATE_TIMEOUT_S, Finding, GateSettings, report_text
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.collective import health_gate
from launcher.schedulers.ssh.hosts import (
    HealthError,
    HostImage,
    HostPlan,
    hosts_of,
    plan_hosts,
    ssh_settings,
)
from launcher.schedulers.ssh.options import SshOptions
from launcher.schedulers.ssh.sync import sync
from launcher.supervisor import procs
from launcher.supervisor.scheduler import SupervisedScheduler
from launcher.supervisor.transport import ChildAgents, start_client

SIGNAL_TIMEOUT_S = 30.0  # for `launcher.agent signal/status` over an established connection
REJOIN_WAIT_S = 600.0  # with no spare, how long a retry waits for the job's hosts to answer again
REJOIN_POLL_S = 10.0
# The hosts' lease (``launcher.agent run --lease-s``): the supervisor writes a byte to every node's ssh stdin
# each LEASE_RENEW_S; a node that heard nothing for LEASE_S ends itself. Longer than ssh's own
# detection of a dead link (ServerAliveInterval 5 s × ServerAliveCountMax 3): the launcher gives up on
# a node before that node gives up on the launcher.
LEASE_S = 30.0
LEASE_RENEW_S = 5.0
BEATS_TIMEOUT_S = 5.0  # for the hosts' last beats when an attempt ends


class SshFacts(Facts):
    hosts: list[str]  # the hosts that run the job, node k on hosts[k]
    master_addr: str  # the first host's address, as every host resolves it
    rdzv_port: int
    ifnames: dict[str, str]  # each host's interface towards master_addr
    omp_num_threads: int | None
    image: str | None = None  # pinned by digest: what every host pulled and runs
    runtimes: dict[str, str] = Field(default_factory=dict)  # with an image: each host's container runtime

    def host_plan(self) -> HostPlan:
        image = HostImage(self.image, self.runtimes) if self.image else None
        return HostPlan(self.hosts, self.master_addr, self.rdzv_port, self.ifnames, {}, image)

    @classmethod
    def of(cls, workdir: str, hosts: HostPlan, spec: JobSpec) -> SshFacts:
        """The facts of ``spec`` on the checked ``hosts``."""
        return cls(
            workdir=workdir,
            hosts=hosts.hosts,
            master_addr=hosts.master_addr,
            rdzv_port=hosts.port,
            ifnames=hosts.ifnames,
            omp_num_threads=spec.omp_num_threads,
            image=hosts.image.image if hosts.image else None,
            runtimes=hosts.image.runtimes if hosts.image else {},
        )


class SshScheduler(SupervisedScheduler):
    name = "ssh"
    files_here = False  # the hosts may not share this machine's files

    def resolve(self, spec: JobSpec) -> SshFacts:
        """Every check of ``launcher.schedulers.ssh.hosts.plan_hosts`` (probes the hosts; starts
        nothing). Raises SpecError, or ParityError (exit 3) for hosts whose versions differ."""
        opts = spec.options(SshOptions)
        if spec.rendezvous.endpoint is not None:
            raise SpecError(
                "rendezvous.endpoint (--rdzv-endpoint) is the first host for the SSH scheduler: "
                "put the host you want first in --hosts / the hostfile"
            )
        workdir = workdir_of(spec, files_here=self.files_here)
        image = None
        if opts.image is not None:
            image = resolve_image(opts.image)
            say(f"launcher: image {opts.image} is {image}")
        # With --sync the workdir is made on submit (``preflight``): a dry run copies nothing.
        checked = None if opts.sync else workdir
        hosts = plan_hosts(
            opts, spec.nnodes, spec.nproc_per_node, spec.python, spec.rendezvous.port, checked, say, image
        )
        return SshFacts.of(workdir, hosts, spec)

    def preflight(self, spec: JobSpec, plan: Plan, job_dir: Path) -> Plan:
        """With ``--health-check`` (or ``--health-check-warn``): the health gate with the job's backend
        settings, interfaces, processes per node and precision (``launcher.preflight.health``). With
        ``--retries``, each host it names is replaced by the hostfile's next spare (which passes every
        check of a submit) and the gate runs again, once per retry. Returns the Plan to run. Raises
        HealthError (exit 3) naming each slow host (``--health-check-warn``: says it and goes on),
        SpecError when the all_reduce cannot form."""
        opts = spec.options(SshOptions)
        sync(opts, [n.host for n in plan.nodes], plan.facts_as(SshFacts).workdir, say)
        if not opts.gate:
            return plan
        excluded: set[str] = set()
        for retry in range(spec.retries + 1):
            named = self._health_gate(spec, plan)
            if not named or opts.health_check_warn:
                if named:
                    say("WARNING: --health-check-warn: launching although the health gate named them (above)")
                return plan
            excluded |= {f.host for f in named}
            current = [n.host for n in plan.nodes]
            free = spares(hosts_of(opts), current, excluded)
            bad = [h for h in current if h in excluded]
            if retry == spec.retries or len(free) < len(bad):
                break
            swap = dict(zip(bad, free, strict=False))
            replaced = ", ".join(f"{old} replaced by spare {new}" for old, new in swap.items())
            say(f"launcher: preflight: {replaced} (--retries)")
            plan = self.replan(spec, [swap.get(h, h) for h in current], plan, job_dir)
        raise HealthError(
            f"the health gate named {len({f.host for f in named})} host(s):\n  "
            + "\n  ".join(f.line for f in named)
            + "\n  fix or replace those hosts (or leave them out of --hosts/--hostfile; with --retries, "
            "spares beyond --nodes in the hostfile replace them); --health-check-warn launches anyway"
        )

    def _health_gate(self, spec: JobSpec, plan: Plan) -> list[Finding]:
        """Run the gate over ``plan``'s hosts, print its report; the findings that name a host."""
        opts = spec.options(SshOptions)
        hosts = plan.facts_as(SshFacts).host_plan()
        gate = GateSettings.of_job(spec.trainer_args, opts.min_busbw, spec.nproc_per_node)
        say(f"launcher: preflight: health gate across {len(hosts.hosts)} host(s) ...")
        started = time.monotonic()
        result, found = health_gate(opts, hosts, spec.python, spec.network.as_env(), gate, GATE_TIMEOUT_S)
        say(format_table(result))
        say(report_text(result, hosts.hosts, found))
        say(f"launcher: preflight took {time.monotonic() - started:.1f} s")
        return [f for f in found if f.fatal]

    def replan(self, spec: JobSpec, hosts: list[str], plan: Plan, job_dir: Path) -> Plan:
        """``plan`` on ``hosts``, after every check of a submit. Raises SpecError / ParityError."""
        opts = spec.options(SshOptions).model_copy(update={"hosts": hosts, "hostfile": None})
        facts = plan.facts_as(SshFacts)
        sync(opts, [h for h in hosts if h not in {n.host for n in plan.nodes}], facts.workdir, say)  # spares
        found = plan_hosts(
            opts,
            len(hosts),
            spec.nproc_per_node,
            spec.python,
            spec.rendezvous.port,
            facts.workdir,
            say,
            facts.image,
        )
        return self.render(spec, SshFacts.of(facts.workdir, found, spec), plan.job_id, job_dir)

    def render(self, spec: JobSpec, facts: SshFacts, job_id: str, job_dir: Path) -> Plan:
        endpoint = f"{facts.master_addr}:{facts.rdzv_port}"
        worker, run_dir = worker_argv(spec, job_dir / "run")
        env = agent_env(spec, job_id, facts.omp_num_threads, run_dir)
        hosts = facts.host_plan()
        python = IMAGE_PYTHON if facts.image is not None else None
        agents = node_agents(
            spec, endpoint=endpoint, job_id=job_id, job_dir=job_dir, worker=worker, python=python
        )
        mounts: tuple[str, ...] = ()
        if facts.image is not None:
            extra = spec.options(SshOptions).container_mounts
            args = [*spec.trainer_args, "--run-dir", run_dir]  # the paths to mount (a program has none)
            mounts = tuple(container_mounts(args, facts.workdir, job_dir, extra))
        nodes = []
        for k, (host, agent) in enumerate(zip(facts.hosts, agents, strict=True)):
            node_env = env | hosts.env(host, env)
            image = []
            if facts.image is not None:  # the agent runs torchrun in a container of the image
                image = ImageRun(facts.image, facts.runtimes[host], mounts, tuple(node_env)).flags()
            argv = agent_argv(spec.python, spec, job_id, k, agent, lease_s=LEASE_S, image_flags=image)
            nodes.append(NodeCommand(host=host, argv=argv, env=node_env))
        return build_plan(self.name, spec, facts, job_id, endpoint=endpoint, run_dir=run_dir, nodes=nodes)

    def transport(self, plan: Plan, record: JobRecord) -> SshAgents:
        spec = record.spec()
        return SshAgents(plan, ssh_settings(spec.options(SshOptions)), spec.python, spec.secrets_here(), self)

    def heartbeats(
        self, record: JobRecord, timeout_s: float = SIGNAL_TIMEOUT_S, skip: Collection[str] = ()
    ) -> dict[int, list[Beat]]:
        """From each host's agent but those in ``skip`` (one connection per host, all at once, each
        for at most ``timeout_s`` seconds)."""
        nodes = {n.host: n.node_rank for n in record.plan().nodes}
        found = {}
        for host, status in _host_status(record, timeout_s, skip).items():
            found[nodes[host]] = status.beats if status is not None else []
        return found

    def remaining(self, record: JobRecord) -> str:
        running = _hosts_running(record)
        return f"still running on {', '.join(running)} (`launcher cancel` stops it)" if running else ""

    def sweep(self, record: JobRecord, grace_s: float) -> None:
        spec = record.spec()
        SshAgents(record.plan(), ssh_settings(spec.options(SshOptions)), spec.python, {}, self).kill(
            record.job_id, grace_s
        )


def _agent_argv(python: str, action: str, job_id: str, node: int) -> list[str]:
    return [python, "-m", "launcher.agent", action, "--job", job_id, "--node", str(node)]


def _agent_command(python: str, action: str, job_id: str, node: int, *extra: str) -> str:
    return f"cd / && {shlex.join([*_agent_argv(python, action, job_id, node), *extra])}"


def _host_status(
    record: JobRecord, timeout_s: float = SIGNAL_TIMEOUT_S, skip: Collection[str] = ()
) -> dict[str, NodeStatus | None]:
    """Each host's ``launcher.agent status`` of its node of the job but those in ``skip``, all asked at
    once (each for at most ``timeout_s`` seconds), as the agent's report on its channel: None where the
    host could not be reached. An answer without that report (an agent of another release) counts as
    a node that does not run."""
    spec = record.spec()
    nodes = {n.host: n.node_rank for n in record.plan().nodes if n.host not in skip}

    def command(host: str) -> str:
        return _agent_command(spec.python, "status", record.job_id, nodes[host])

    found: dict[str, NodeStatus | None] = {}
    for result in ssh.fan_out(ssh_settings(spec.options(SshOptions)), list(nodes), command, timeout_s):
        answers = [r for r in channel_reports(result.raw)[1] if isinstance(r, NodeStatus)]
        unreachable = result.returncode is None or result.returncode == ssh.SSH_FAILED
        silent = NodeStatus(node=nodes[result.host], running=False, exit_code=None)
        found[result.host] = answers[-1] if answers else None if unreachable else silent
    return found


def _hosts_running(record: JobRecord) -> list[str]:
    """The hosts where a node of the job still runs. A host that cannot be reached counts as running:
    nothing says its node is gone."""
    return [host for host, status in _host_status(record).items() if status is None or status.running]


class SshAgents(ChildAgents):
    """The supervisor's transport for SSH: one ``ssh host python -m launcher.agent run`` client a node."""

    def __init__(
        self,
        plan: Plan,
        settings: ssh.SshSettings,
        python: str,
        secrets: dict[str, str],
        scheduler: SshScheduler,
    ) -> None:
        self.plan, self.settings, self.python, self.secrets = plan, settings, python, secrets
        self.scheduler = scheduler
        self.failed: set[str] = set()  # hosts a failure was named on: never a spare again
        self.clients: list[subprocess.Popen[bytes]] = []  # whose stdin carries the nodes' lease
        self.lost: set[str] = set()  # hosts whose connection was lost in this attempt
        self.renewer: threading.Thread | None = None

    def renew(self, record: JobRecord, failed_host: str | None) -> Plan | None:
        """For a retry: the first spare of the hostfile (hosts beyond ``--nodes``) that passes every
        check of a submit, in place of ``failed_host``; with none, the same hosts once they all answer
        again (every REJOIN_POLL_S, for at most REJOIN_WAIT_S). The new Plan (None: ``failed_host``
        is not one of the job's). Raises OSError when no set of hosts can run the next attempt."""
        current = [n.host for n in self.plan.nodes]
        self.lost = set()  # the next attempt's hosts answer again, or are replaced
        if failed_host not in current:
            return None
        spec = record.spec()
        opts = spec.options(SshOptions)
        self.failed.add(failed_host)
        for spare in spares(hosts_of(opts), current, self.failed):
            try:
                return self._replan(record, [spare if h == failed_host else h for h in current])
            except SpecError as e:
                say(f"launcher: spare host {spare} cannot take over from {failed_host}: {e}")
        deadline = time.monotonic() + REJOIN_WAIT_S
        while True:
            try:
                return self._replan(record, current)
            except SpecError as e:
                if time.monotonic() > deadline:
                    raise OSError(
                        f"no spare host in the hostfile could replace {failed_host}, and the job's hosts did "
                        f"not all answer within {REJOIN_WAIT_S:.0f} s: {e}"
                    ) from None
                time.sleep(REJOIN_POLL_S)

    def _replan(self, record: JobRecord, hosts: list[str]) -> Plan:
        """The job's Plan on ``hosts``, after the checks of a submit (probes, parity, workdir, routes,
        port). Raises SpecError."""
        self.plan = self.scheduler.replan(record.spec(), hosts, self.plan, record.dir)
        return self.plan

    def start(self, node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
        # The secrets travel inside the encrypted channel, read once by the node agent; stdin then
        # carries the lease, stdout the agent's channel: its output and its reports.
        argv = self.settings.argv(node.host, node.shell_command())
        client = start_client(
            argv, record.dir / node.log, self.secrets, keep_stdin=True, channel_of=record.dir
        )
        self.clients.append(client)
        if self.renewer is None:
            self.renewer = threading.Thread(target=self._renew_leases, daemon=True)
            self.renewer.start()
        return client

    def keep_beats(self, record: JobRecord) -> None:
        """The hosts' last beats into ``JOB/heartbeat/`` (a host that does not answer within
        BEATS_TIMEOUT_S is left out: a lost host must not hold up the next attempt)."""
        for node, beats in self.scheduler.heartbeats(record, BEATS_TIMEOUT_S, skip=self.lost).items():
            directory = heartbeat_dir(record.dir, node)
            directory.mkdir(parents=True, exist_ok=True)
            for beat in beats:
                write_beat(directory, beat)

    def _renew_leases(self) -> None:
        """A byte to every live node every LEASE_RENEW_S, for the life of the supervisor."""
        while True:
            time.sleep(LEASE_RENEW_S)
            for client in list(self.clients):
                try:
                    assert client.stdin is not None
                    client.stdin.write(b"\n")
                    client.stdin.flush()
                except (OSError, ValueError):  # it ended (or was closed): its node is on its own
                    self.clients.remove(client)

    def stop(self, agents: list[subprocess.Popen[bytes]]) -> None:
        nodes = [n for n, a in zip(self.plan.nodes, agents, strict=False) if a.poll() is None]
        self._signal(nodes, "TERM", 0.0)

    def kill(self, job_id: str, grace_s: float) -> None:
        self._signal(self.plan.nodes, "KILL", grace_s)
        procs.terminate(psutil.Process().children(recursive=True), grace_s)  # ssh clients, masters

    def explain(self, node: NodePlan, exit_code: int | None) -> str | None:
        if exit_code != ssh.SSH_FAILED:
            return None
        self.lost.add(node.host)
        return (
            f"the ssh connection to node {node.node_rank} failed or was lost (ssh exit code 255: the host "
            "went down or the network failed)"
        )

    def _signal(self, nodes: list[NodePlan], sig: str, grace_s: float) -> None:
        # A host whose connection was lost is not waited on: its node ends itself (the lease).
        by_host = {n.host: n for n in nodes if n.host not in self.lost}
        extra = ("--signal", sig, "--grace-s", f"{grace_s:g}")

        def command(host: str) -> str:
            return _agent_command(self.python, "signal", self.plan.job_id, by_host[host].node_rank, *extra)

        for result in ssh.fan_out(self.settings, list(by_host), command, SIGNAL_TIMEOUT_S + grace_s):
            if not result.ok:
                say(f"launcher: could not signal the job on {result.error()}")
