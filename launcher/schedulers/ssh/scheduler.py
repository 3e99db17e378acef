"""The SSH scheduler (docs/schedulers/ssh.md): every check of ``launcher.schedulers.ssh.hosts`` before
anything starts, then a supervisor on this machine runs one ``ssh host ...`` per node (``SshAgents``),
whose output is the node's log here. On each host the node agent (``launcher.agent``) tracks the
torchrun agent's process tree, so that a dropped connection neither kills nor orphans the node.
"""

from __future__ import annotations

import time
from pathlib import Path

from gptlaunch.contract import Beat
from launcher.agent.transport import agent_argv, back_flags
from launcher.image.reference import resolve as resolve_image
from launcher.image.runtime import ImageRun
from launcher.job.console import say
from launcher.job.measurements import CollectiveResult, Probe
from launcher.job.plan import Facts, NodeCommand, Plan, UnresolvedHosts, build_plan, workdir_of
from launcher.job.record import JobRecord
from launcher.job.retry import spares
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import (
    IMAGE_PYTHON,
    agent_env,
    check_warm_program,
    container_mounts,
    copy_excludes,
    node_agents,
    warm_worker,
    warm_workers,
    worker_argv,
    zygote_name,
)
from launcher.preflight import recorded
from launcher.preflight.health import GATE_TIMEOUT_S, Finding, GateSettings, named_text, report_text
from launcher.schedulers.ssh import needs
from launcher.schedulers.ssh.agents import LEASE_S, SshAgents, host_beats, host_status
from launcher.schedulers.ssh.collective import health_gate
from launcher.schedulers.ssh.copies import sync
from launcher.schedulers.ssh.hosts import HostPlan, hosts_of, master_address, plan_hosts, ssh_settings
from launcher.schedulers.ssh.needs import HostsRefused
from launcher.schedulers.ssh.options import SshOptions
from launcher.supervisor.scheduler import SupervisedScheduler
from launcher.supervisor.supervisor import SupervisorHandle

TORCHRUN_DEFAULT_PORT = 29500  # torchrun's --master-port default


class SshFacts(HostPlan, Facts):
    omp_num_threads: int | None


def _unchecked(spec: JobSpec, workdir: str, image: str | None) -> SshFacts:
    """The facts of ``spec`` without the checks that reach the hosts: no interface chosen, the
    rendezvous port torchrun's default unless given, the image run with the configured runtime."""
    opts = spec.options(SshOptions)
    hosts = hosts_of(opts, spec.nnodes, spec.nproc_per_node)
    runtime = "podman" if opts.container_runtime == "auto" else opts.container_runtime
    return SshFacts(
        workdir=workdir,
        hosts=hosts,
        master_addr=master_address(ssh_settings(opts), hosts[0]),
        rdzv_port=spec.rendezvous.port or TORCHRUN_DEFAULT_PORT,
        ifnames={},
        omp_num_threads=spec.omp_num_threads,
        image=image,
        runtimes=dict.fromkeys(hosts, runtime) if image else {},
    )


class SshScheduler(SupervisedScheduler):
    name = "ssh"
    files_here = False  # the hosts may not share this machine's files
    # What this submit's checks found, for the job record (``submit``): each node's probe, in node
    # order, and the health gate's result.
    _probes: tuple[Probe, ...] = ()
    _health: CollectiveResult | None = None

    def resolve(self, spec: JobSpec) -> SshFacts:
        """Every check of ``launcher.schedulers.ssh.hosts.plan_hosts`` (probes the hosts; starts
        nothing). Raises SpecError, or HostsRefused (exit 3) for hosts whose versions differ."""
        opts = spec.options(SshOptions)
        if spec.rendezvous.endpoint is not None:
            raise SpecError(
                "rendezvous.endpoint (--rdzv-endpoint) is the first host for the SSH scheduler: "
                "put the host you want first in --hosts / the hostfile"
            )
        check_warm_program(spec)
        workdir = workdir_of(spec, files_here=self.files_here)
        image = None
        if opts.image is not None:
            image = resolve_image(opts.image)
            say(f"launcher: image {opts.image} is {image}")
        # With --sync the workdir is made on submit (``preflight``): a dry run copies nothing.
        checked = None if opts.sync else workdir
        try:
            hosts, probes = plan_hosts(spec, opts, checked, say, image)
        except UnresolvedHosts as e:  # a dry run still prints the plan, with these hosts marked
            raise UnresolvedHosts(str(e), e.hosts, _unchecked(spec, workdir, image)) from None
        return self._checked(spec, hosts, probes, workdir)

    def _checked(self, spec: JobSpec, hosts: HostPlan, probes: dict[str, Probe], workdir: str) -> SshFacts:
        """The facts of ``plan_hosts``' checked ``hosts``, whose probes the job record keeps (``submit``)."""
        self._probes = tuple(probes[h] for h in hosts.hosts)
        return SshFacts(**hosts.model_dump(), workdir=workdir, omp_num_threads=spec.omp_num_threads)

    def preflight(self, spec: JobSpec, plan: Plan, job_dir: Path) -> Plan:
        """With ``--health-check`` (or ``--health-check-warn``): the health gate with the job's backend
        settings, interfaces, processes per node and precision (``launcher.preflight.health``). With
        ``--retries``, each host it names is replaced by the hostfile's next spare (which passes every
        check of a submit) and the gate runs again, once per retry. Returns the Plan to run. Raises
        HostsRefused (exit 3) naming each slow host (``--health-check-warn``: says it and goes on),
        SpecError when the all_reduce cannot form."""
        opts = spec.options(SshOptions)
        hosts = [n.host for n in plan.nodes]
        check_needs(opts, hosts, spec.python, job_dir)
        sync(opts, hosts, plan.facts_as(SshFacts).workdir, say)
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
        raise HostsRefused(
            named_text(named)
            + "\n  fix or replace those hosts (or leave them out of --hosts/--hostfile; with --retries, "
            "spares beyond --nodes in the hostfile replace them); --health-check-warn launches anyway"
        )

    def _health_gate(self, spec: JobSpec, plan: Plan) -> list[Finding]:
        """Run the gate over ``plan``'s hosts, print its report; the findings that name a host."""
        opts = spec.options(SshOptions)
        hosts = plan.facts_as(SshFacts)
        gate = GateSettings.of_job(spec.trainer_args, opts, spec.nproc_per_node)
        say(f"launcher: preflight: health gate across {len(hosts.hosts)} host(s) ...")
        started = time.monotonic()
        result, found = health_gate(opts, hosts, spec.python, spec.network.as_env(), gate, GATE_TIMEOUT_S)
        self._health = result
        say(report_text(result, hosts.hosts, found))
        say(f"launcher: preflight took {time.monotonic() - started:.1f} s")
        return [f for f in found if f.fatal]

    def replan(self, spec: JobSpec, hosts: list[str], plan: Plan, job_dir: Path) -> Plan:
        """``plan`` on ``hosts`` (one per node), after every check of a submit. Raises SpecError /
        HostsRefused."""
        opts = spec.options(SshOptions).model_copy(update={"hosts": hosts, "hostfile": None})
        facts = plan.facts_as(SshFacts)
        added = [h for h in hosts if h not in {n.host for n in plan.nodes}]
        check_needs(opts, added, spec.python, job_dir)
        sync(opts, added, facts.workdir, say)
        found, probes = plan_hosts(spec, opts, facts.workdir, say, facts.image)
        return self.render(spec, self._checked(spec, found, probes, facts.workdir), plan.job_id, job_dir)

    def submit(self, plan: Plan, record: JobRecord, *, detach: bool) -> SupervisorHandle:
        """Record the checks this submit ran (``launcher.preflight.recorded``: for the report), then
        start the job as every supervised one."""
        hosts = [n.host for n in plan.nodes]
        try:
            recorded.write(record.dir, list(self._probes), self._health, hosts)
        except OSError as e:  # the report goes without them: no reason to refuse the job
            say(f"launcher: WARNING: the checks' results are not in the job record ({e})")
        return super().submit(plan, record, detach=detach)

    def render(self, spec: JobSpec, facts: SshFacts, job_id: str, job_dir: Path) -> Plan:
        endpoint = f"{facts.master_addr}:{facts.rdzv_port}"
        worker, run_dir = worker_argv(spec, job_dir / "run")
        if warm_workers(spec):
            worker = warm_worker(worker, zygote_name(job_id))
        env = agent_env(spec, job_id, facts.omp_num_threads, run_dir)
        python = IMAGE_PYTHON if facts.image is not None else None
        agents = node_agents(
            spec, endpoint=endpoint, job_id=job_id, job_dir=job_dir, worker=worker, python=python
        )
        mounts = container_mounts(spec, run_dir, facts.workdir, job_dir) if facts.image is not None else ()
        # A relative run dir is the workdir's, as the trainer takes it.
        run_here = Path(facts.workdir) / run_dir
        excluded = copy_excludes(spec, facts.workdir, str(run_here))
        nodes = []
        for k, (host, agent) in enumerate(zip(facts.hosts, agents, strict=True)):
            node_env = env | facts.env(host, env)
            image = []
            if facts.image is not None:  # the agent runs torchrun in a container of the image
                image = ImageRun(facts.image, facts.runtimes[host], mounts, tuple(node_env)).flags()
            back = back_flags(job_dir, k, run_here, excluded)
            argv = agent_argv(
                spec.python, spec, job_id, k, agent, lease_s=LEASE_S, image_flags=image, back_flags=back
            )
            nodes.append(NodeCommand(host=host, argv=argv, env=node_env))
        return build_plan(self.name, spec, facts, job_id, endpoint=endpoint, run_dir=run_dir, nodes=nodes)

    def transport(self, plan: Plan, record: JobRecord) -> SshAgents:
        agents = SshAgents(plan, record.spec().secrets_here(), record, replan=self.replan)
        agents.copies.mark(record.job_id)
        return agents

    def heartbeats(self, record: JobRecord) -> dict[int, list[Beat]]:
        """From each host's agent (one connection per host, all at once)."""
        return host_beats(record)

    def remaining(self, record: JobRecord) -> str:
        # A host that cannot be reached counts as running: nothing says its node is gone.
        running = [host for host, status in host_status(record).items() if status is None or status.running]
        return f"still running on {', '.join(running)} (`launcher cancel` stops it)" if running else ""

    def sweep(self, record: JobRecord, grace_s: float) -> None:
        SshAgents(record.plan(), {}, record, replan=self.replan).kill(record.job_id, grace_s)


def check_needs(opts: SshOptions, hosts: list[str], python: str, job_dir: Path) -> None:
    """Refuse the job before any rank starts when this machine or one of ``hosts`` lacks a program it
    needs (``launcher.schedulers.ssh.needs``). Raises SpecError (here) or HostsRefused (a host)."""
    if hosts:
        answers = needs.ask(ssh_settings(opts), hosts, python, needs.near_record(job_dir))
        needs.check(answers, opts.sync is not None, say)
