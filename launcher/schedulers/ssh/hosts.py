"""Checks of a set of SSH hosts before a job uses them: reachability, version parity, the master
address and rendezvous port, the network interface of each host (the collective across them:
``launcher.schedulers.ssh.collective``). ``launcher check`` runs them on their own; the SSH scheduler
runs them before every submit. Every remote step runs on all hosts at once (``ssh.fan_out``), and
each failure raises SpecError (or HostsRefused) naming the host and the fix.
"""

from __future__ import annotations

import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from launcher.agent.transport import agent_cmd, channel_reports, remote
from launcher.image.runtime import NO_RUNTIME, PULL_TIMEOUT_S, exec_argv
from launcher.job.measurements import Probe
from launcher.job.plan import UnresolvedHosts
from launcher.job.reports import Probed, Pulled
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import IMAGE_PYTHON
from launcher.preflight.parity import classes, compare, diff_text
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.needs import HostsRefused
from launcher.schedulers.ssh.options import SshOptions

PROBE_TIMEOUT_S = 120.0  # a cold `import torch` on a busy host can take tens of seconds
PORT_TIMEOUT_S = 10.0


def ssh_settings(opts: SshOptions) -> ssh.SshSettings:
    return ssh.SshSettings(
        options=tuple(opts.ssh_opts),
        host_key_check=opts.host_key_check,
        connect_timeout_s=opts.connect_timeout_s,
        max_parallel=opts.max_parallel,
    )


def hosts_of(opts: SshOptions, nnodes: int | None = None, nproc_per_node: int = 1) -> list[str]:
    """The job's hosts: ``--hosts`` or the hostfile's, the first ``nnodes`` of them (all if None).
    Raises SpecError for an unreadable or malformed hostfile, too few hosts, or too few slots."""
    hosts = [ssh.Host(h) for h in opts.hosts]
    if opts.hostfile is not None:
        try:
            text = opts.hostfile.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SpecError(f"hostfile (--hostfile) {opts.hostfile}: cannot read it ({e})") from None
        try:
            hosts = ssh.parse_hostfile(text, f"hostfile {opts.hostfile}")
        except ValueError as e:
            raise SpecError(str(e)) from None
    if nnodes is not None:
        if nnodes < 1:
            raise SpecError(f"--nodes {nnodes}: a job needs at least one node")
        if len(hosts) < nnodes:
            raise SpecError(
                f"--nodes {nnodes} needs {nnodes} hosts, {len(hosts)} are given: add hosts or lower --nodes"
            )
        hosts = hosts[:nnodes]
    for host in hosts:
        if host.slots is not None and host.slots < nproc_per_node:
            raise SpecError(
                f"host {host.name} has slots={host.slots}, fewer than --gpus-per-node {nproc_per_node}"
            )
    return [h.name for h in hosts]


def master_address(settings: ssh.SshSettings, host: str) -> str:
    """The address the other hosts use to reach ``host``: the HostName ssh's configuration gives it
    (``ssh -G``: an alias of ~/.ssh/config becomes its real name; ``user@`` is dropped)."""
    argv = ["ssh", "-G", *(a for o in settings.options for a in ("-o", o)), "--", host]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return host.split("@")[-1]
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip():
            return value.strip()
    return host.split("@")[-1]


def pull_image(
    settings: ssh.SshSettings,
    hosts: list[str],
    python: str,
    image: str,
    runtime: str,
    say: Callable[[str], None],
) -> dict[str, str]:
    """Every host pulls ``image`` with ``runtime`` ("auto": podman, else docker) at once, each named
    as it finishes; the runtime each host runs it with. Raises SpecError naming every host that could
    not pull, with the registry's (or the runtime's) error."""

    def command(host: str) -> str:
        pull = ["--node", str(hosts.index(host)), "--runtime", runtime, "--image", image]
        return remote(agent_cmd(python, "pull", *pull))

    def done(result: ssh.Result) -> None:
        if result.ok:
            say(f"launcher: {result.host}: image pulled in {result.seconds:.1f} s")

    say(f"launcher: pulling {image} on {', '.join(hosts)} ...")
    results = ssh.fan_out(settings, hosts, command, settings.connect_timeout_s + PULL_TIMEOUT_S, done)
    _refuse_unresolved(results)
    runtimes, errors, no_runtime = {}, [], []
    for result in results:
        pulled = [r.runtime for r in channel_reports(result.raw)[1] if isinstance(r, Pulled)]
        if pulled:
            runtimes[result.host] = pulled[-1]
            continue
        # the runtime's (or the registry's) error, which the agent printed last
        why = result.stderr.strip().splitlines()[-1:] if result.returncode == 1 else []
        error = why[0].removeprefix("error: ") if why else ""
        if error.startswith(NO_RUNTIME):
            no_runtime.append(f"{result.host}: {error}")
        errors.append(f"{result.host}: {error}" if error else result.error())
    if no_runtime:  # a host to fix, not a registry to reach: exit 3, as for any other program it lacks
        raise HostsRefused("--image needs a container runtime on every host:\n  " + "\n  ".join(no_runtime))
    if errors:
        raise SpecError(
            f"cannot pull the image {image} on every host:\n  " + "\n  ".join(errors) + "\n  check that "
            "the registry is reachable from those hosts and trusted by their runtime (its CA in "
            "/etc/containers/certs.d or /etc/docker/certs.d), and that they are logged in where it needs it"
        )
    return runtimes


def _refuse_unresolved(results: list[ssh.Result]) -> None:
    """Raise UnresolvedHosts (without facts: the scheduler adds them) when every host that failed
    failed because its name does not resolve here."""
    failed = [r for r in results if not r.ok]
    if failed and all(r.unresolved for r in failed):
        names = [r.host for r in failed]
        raise UnresolvedHosts(
            f"{len(names)} host(s) do not resolve here: {', '.join(names)}; check the names, /etc/hosts "
            "or ~/.ssh/config (HostName)",
            names,
        )


def probe_hosts(
    settings: ssh.SshSettings,
    hosts: list[str],
    python: str,
    master_addr: str,
    image: str | None,
    runtimes: dict[str, str],
) -> dict[str, Probe]:
    """Run the probe on every host at once (inside ``image`` when given, with each host's runtime of
    ``runtimes``: the image's versions, the host's network and GPUs), with its route to and
    resolution of ``master_addr``; host 0 also reports a free port. Raises SpecError listing every
    host that could not be reached or probed."""

    def command(host: str) -> str:
        args = ["--node", str(hosts.index(host)), "--route-to", master_addr, "--resolve", master_addr]
        if host == hosts[0]:
            args.append("--free-port")
        if image is None:
            return remote(agent_cmd(python, "probe", *args))
        return remote(exec_argv(python, runtimes[host], image, agent_cmd(IMAGE_PYTHON, "probe", *args)))

    results = ssh.fan_out(settings, hosts, command, settings.connect_timeout_s + PROBE_TIMEOUT_S)
    _refuse_unresolved(results)
    probes, errors = {}, []
    for result in results:
        # The report on the agent's channel; the rest of its output is for people.
        found = [r.probe for r in channel_reports(result.raw)[1] if isinstance(r, Probed)]
        if found:
            probes[result.host] = found[-1]
        else:
            errors.append(result.error() if not result.ok else f"{result.host}: the probe sent no report")
    if errors:
        hint = (
            f"(the probe runs `{python} -m launcher.agent probe`: gptlaunch must be installed in that "
            "interpreter on every host; --python names it)"
        )
        raise SpecError("cannot check every host:\n  " + "\n  ".join(errors) + f"\n  {hint}")
    return probes


def choose_ifnames(probes: dict[str, Probe], master_addr: str, multi_host: bool) -> dict[str, str]:
    """Per host, the interface that reaches ``master_addr`` (``ip route get``): on host 0 itself the
    interface that holds the address. Never ``lo`` for a multi-host job. Raises SpecError when a
    host cannot resolve or route to the master address."""
    chosen = {}
    for host, probe in probes.items():
        address = probe.resolved.get(master_addr)
        if address is None or probe.route is None:
            raise SpecError(
                f"master_addr {master_addr} does not resolve on host {host}: add it to that host's DNS or "
                "/etc/hosts, or name the first host by an address"
            )
        dev = probe.route.dev
        if dev == "lo":  # master_addr is this host: take the interface that holds the address
            dev = next((i for i, addrs in probe.interfaces.items() if address in addrs), "lo")
        if dev == "lo" and multi_host:
            raise SpecError(
                f"master_addr {master_addr} is a loopback address ({address}) on host {host}: the other "
                "hosts cannot reach it there. Map the first host's name to its network address (e.g. "
                "Debian's `127.0.1.1 hostname` line in /etc/hosts), or list the first host by address"
            )
        chosen[host] = dev
    return chosen


def check_port(settings: ssh.SshSettings, hosts: list[str], python: str, master_addr: str, port: int) -> None:
    """Host 0 listens on ``port`` while every other host connects to ``master_addr:port``. Raises
    SpecError naming the port and the hosts that could not connect (bounded by PORT_TIMEOUT_S)."""
    if len(hosts) < 2:
        return
    timeout, wait = str(PORT_TIMEOUT_S), PORT_TIMEOUT_S + settings.connect_timeout_s + 10
    tool = [python, "-m", "launcher.preflight.netcheck"]
    listen = remote([*tool, "listen", str(port), "--expect", str(len(hosts) - 1), "--timeout-s", timeout])
    box: list[ssh.Result] = []
    listener = threading.Thread(target=lambda: box.append(ssh.run(settings, hosts[0], listen, wait)))
    listener.start()
    connect = remote([*tool, "connect", master_addr, str(port), "--timeout-s", timeout])
    results = ssh.fan_out(settings, hosts[1:], lambda h: connect, wait, all_at_once=True)  # within the listen
    listener.join()
    failed = [r for r in results if not r.ok]
    if box and not box[0].ok and "cannot be bound" in box[0].stdout:
        raise SpecError(
            f"rendezvous port {port} is in use on {hosts[0]}: pass another --rdzv-port (or leave it unset)"
        )
    if failed:
        raise SpecError(
            f"rendezvous port {port} on {hosts[0]} ({master_addr}) is not reachable from "
            + ", ".join(f"{r.host} ({r.stdout.strip() or r.error()})" for r in failed)
            + ": open it in the firewall between the hosts, or pass another --rdzv-port"
        )


class HostPlan(BaseModel):
    """What the checks decided for a job's hosts (the fields of ``SshFacts``, in its job records)."""

    model_config = ConfigDict(frozen=True)
    hosts: list[str]  # the hosts that run the job, node k on hosts[k]
    master_addr: str  # the first host's address, as every host resolves it
    rdzv_port: int
    ifnames: dict[str, str]  # each host's interface towards master_addr
    image: str | None = None  # pinned by digest: what every host pulled and runs
    runtimes: dict[str, str] = Field(default_factory=dict)  # with an image: each host's container runtime

    def env(self, host: str, user_env: dict[str, str]) -> dict[str, str]:
        """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for ``host``, unless the user set them."""
        if host not in self.ifnames:  # not probed (a dry run whose hosts do not resolve)
            return {}
        chosen = {"NCCL_SOCKET_IFNAME": self.ifnames[host], "GLOO_SOCKET_IFNAME": self.ifnames[host]}
        return {k: v for k, v in chosen.items() if k not in user_env}


@dataclass(frozen=True)
class ProbedHosts:
    """The job's hosts as probed: what ``launcher check`` reports before any routing is chosen."""

    settings: ssh.SshSettings
    hosts: list[str]
    master_addr: str
    probes: dict[str, Probe]
    probe_s: float  # wall time of the parallel probe, seconds
    image: str | None = None
    runtimes: dict[str, str] = field(default_factory=dict)  # with an image: each host's container runtime


def probe_job_hosts(
    opts: SshOptions,
    hosts: list[str],
    python: str,
    image: str | None = None,
    say: Callable[[str], None] = lambda line: None,
    master_host: str | None = None,
) -> ProbedHosts:
    """Every host's probe, in parallel, towards the address of ``master_host`` (default: the first
    host); with ``image`` (pinned by digest), every host pulls it first and the probe runs inside it.
    Raises SpecError naming each host that could not be reached, pull or be probed."""
    settings = ssh_settings(opts)
    master = master_address(settings, master_host or hosts[0])
    runtimes = {}
    if image is not None:
        runtimes = pull_image(settings, hosts, python, image, opts.container_runtime, say)
    started = time.monotonic()
    probes = probe_hosts(settings, hosts, python, master, image, runtimes)
    return ProbedHosts(settings, hosts, master, probes, time.monotonic() - started, image, runtimes)


def route_hosts(probed: ProbedHosts, port: int | None, python: str) -> HostPlan:
    """Each host's interface towards the master address and a rendezvous port (``port``, or the one
    host 0 found free) that every host reaches. Raises SpecError naming the host and the fix."""
    hosts = probed.hosts
    ifnames = choose_ifnames(probed.probes, probed.master_addr, multi_host=len(hosts) > 1)
    chosen_port = port or probed.probes[hosts[0]].free_port
    if chosen_port is None:
        raise SpecError(f"host {hosts[0]} reported no free port: pass --rdzv-port")
    check_port(probed.settings, hosts, python, probed.master_addr, chosen_port)
    return HostPlan(
        hosts=hosts,
        master_addr=probed.master_addr,
        rdzv_port=chosen_port,
        ifnames=ifnames,
        image=probed.image,
        runtimes=probed.runtimes,
    )


def check_workdir(settings: ssh.SshSettings, hosts: list[str], workdir: str) -> None:
    """Raise SpecError naming every host where ``workdir`` is not a directory (all hosts at once),
    or that could not be asked."""
    command = f"test -d {shlex.quote(workdir)}"
    results = ssh.fan_out(settings, hosts, lambda h: command, settings.connect_timeout_s + 30)
    missing = [r.host for r in results if r.returncode == 1]  # test's "no"
    if missing:
        raise SpecError(
            f"workdir (--workdir) {workdir} is not a directory on {', '.join(missing)}: every host runs the "
            "trainer there; create it on those hosts or pass another --workdir"
        )
    failed = [r.error() for r in results if not r.ok]
    if failed:
        raise SpecError("cannot check the workdir on every host:\n  " + "\n  ".join(failed))


def plan_hosts(
    spec: JobSpec, opts: SshOptions, workdir: str | None, warn: Callable[[str], None], image: str | None
) -> tuple[HostPlan, dict[str, Probe]]:
    """Every check before ``spec``'s job on ``opts``' hosts, in order: hosts, the pull of ``image``
    (pinned by digest) and probes inside it (in parallel), parity, the workdir (None: not checked,
    ``--sync`` makes it), master address resolution and routes, rendezvous port. Returns the plan and
    each host's probe. Raises SpecError / HostsRefused."""
    hosts = hosts_of(opts, spec.nnodes, spec.nproc_per_node)
    probed = probe_job_hosts(opts, hosts, spec.python, image, warn)
    if image is not None:  # what each host's probe found inside the image
        for host, probe in probed.probes.items():
            found = f"image_digest={probe.image_digest} torch={probe.torch}"
            warn(f"launcher: {host}: probed in the image: {found}")
    mismatches, shortfalls = compare(probed.probes, spec.nproc_per_node)
    if mismatches or shortfalls:  # the field-by-field diff; --skip-parity says it and goes on
        diff = diff_text(mismatches, shortfalls)
        if not opts.skip_parity:
            raise HostsRefused(diff)
        warn(f"WARNING: --skip-parity: launching although the hosts differ:\n{diff}")
    warn(f"launcher: parity: {classes(probed.probes).splitlines()[0]}")  # one line, however many hosts
    if workdir is not None:
        check_workdir(probed.settings, probed.hosts, workdir)
    return route_hosts(probed, spec.rendezvous.port, spec.python), probed.probes
