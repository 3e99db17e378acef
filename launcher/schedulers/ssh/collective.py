"""The collective preflight across SSH hosts: a short all_reduce over the hosts' chosen interfaces
(``launcher.preflight.collective`` under torchrun on every host at once, under the node agent, in the
job's image when it has one: the workers' reports come back on the agent's channel), and the health
gate built on it (``launcher.preflight.health``). ``launcher check
--collective`` and ``submit --health-check`` run them; a failure raises SpecError naming the hosts,
their interfaces and the fix.
"""

from __future__ import annotations

import dataclasses
import uuid

from launcher.agent.transport import channel_reports
from launcher.image.runtime import ImageRun
from launcher.job import reports
from launcher.job.measurements import CollectiveResult
from launcher.job.spec import SpecError
from launcher.job.torchrun import IMAGE_PYTHON
from launcher.preflight.gpu_health import QUERY_TIMEOUT_S
from launcher.preflight.health import Finding, GateSettings, findings
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.agents import agent_command
from launcher.schedulers.ssh.hosts import HostPlan, ssh_settings
from launcher.schedulers.ssh.options import SshOptions


def health_gate(
    opts: SshOptions, plan: HostPlan, python: str, env: dict[str, str], gate: GateSettings, timeout_s: float
) -> tuple[CollectiveResult, list[Finding]]:
    """A short all_reduce across the hosts (``launcher.preflight.collective`` under torchrun,
    ``gate.gpus_per_node`` processes per host, in the job's image when it has one) with the job's
    interface choice and ``env``, plus the health gate's stages (``launcher.preflight.health``);
    returns rank 0's result and what the gate found: the hosts it names (``fatal``) and warnings.
    Raises SpecError with every rank's error when it fails, naming the hosts and interfaces when the
    group could not form within ``timeout_s``."""
    settings = ssh_settings(opts)
    n = len(plan.hosts)
    run_id = f"collective-{uuid.uuid4().hex[:12]}"  # the agents' files on each host, this run's alone

    def command(host: str) -> str:
        node = plan.hosts.index(host)
        node_env = plan.env(host, env) | env
        master = (plan.master_addr, plan.rdzv_port)
        torchrun = gate.worker_argv(n, node, master, timeout_s)
        workers = ["env", *(f"{k}={v}" for k, v in sorted(node_env.items()))]
        workers += [IMAGE_PYTHON if plan.image else python, *torchrun]
        image = ImageRun(plan.image, plan.runtimes[host], (), ()).flags() if plan.image else []
        # Under the node agent: the workers' reports come back on its channel.
        return agent_command(python, "run", run_id, node, *image, "--", *workers)

    # Beyond one all_reduce: the matmuls, the nvidia-smi query and the pair rounds, each call bounded.
    extra_s = gate.compute_s + 2 * QUERY_TIMEOUT_S + timeout_s
    wait = timeout_s + extra_s + settings.connect_timeout_s + 30
    results = ssh.fan_out(settings, plan.hosts, command, wait, all_at_once=True)  # ranks wait for each other
    sent: list[reports.NodeReport] = []  # the workers' reports on the agents' channels
    for k, result in enumerate(results):
        output, found = channel_reports(result.raw)
        results[k] = dataclasses.replace(result, stdout=output)
        sent += found
    sent.sort(key=lambda r: r.time)  # oldest first, as a job record's are read
    done = [r for r in sent if isinstance(r, reports.CollectiveDone)]
    reported = [r.error for r in sent if isinstance(r, reports.CollectiveFailed)]
    if done and all(r.ok for r in results):
        return done[-1].result, findings(done[-1].result, plan.hosts, plan.ifnames, gate)
    where = ", ".join(
        f"{h} ({'GLOO_SOCKET_IFNAME=' + (env.get('GLOO_SOCKET_IFNAME') or plan.ifnames[h])})"
        for h in plan.hosts
    )
    errors = (
        [e.message for e in reported] or [r.error() for r in results if not r.ok] or ["no result from rank 0"]
    )
    network = not reported or any(e.phase == "init" for e in reported)  # the group did not form
    hint = (
        "\n  check that the interface reaches the other hosts (`ip route get <master_addr>`), or set "
        "--gloo-socket-ifname/--nccl-socket-ifname"
        if network
        else ""
    )
    raise SpecError(f"the all_reduce across {where} failed:\n  " + "\n  ".join(errors) + hint)
