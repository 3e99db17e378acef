"""The supervisor's transport for SSH (``SshAgents``): one ``ssh host python -m launcher.agent run``
client a node, its stdin the node's lease and its stdout the agent's channel; ``launcher.agent
signal`` over ssh to stop or end a node, and ``status`` to ask after it (``host_status``, which the
scheduler asks too); a spare host in place of each failed one for a retry (the spares made ready
while the job runs); and, for hosts that share no file system with the launcher, the checkpoint
copies (``copies``). It asks the scheduler for a Plan on other hosts through the callable it is
given (``Replan``): the scheduler imports this module, never the other way round.
"""

from __future__ import annotations

import functools
import itertools
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import psutil

from gptlaunch.contract import Beat, write_beat
from launcher.agent.transport import agent_cmd, channel_reports, remote
from launcher.job.console import say
from launcher.job.hang import heartbeat_dir
from launcher.job.plan import NodePlan, Plan
from launcher.job.record import JobRecord
from launcher.job.reports import NodeReport, NodeStatus
from launcher.job.retry import spares
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import copy_excludes, warm_workers
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.copies import Copies, sync
from launcher.schedulers.ssh.hosts import hosts_of, probe_job_hosts, ssh_settings
from launcher.schedulers.ssh.options import SshOptions
from launcher.schedulers.ssh.zygotes import Zygotes
from launcher.supervisor import procs
from launcher.supervisor.transport import DRAIN_S, Transport, drain_channels, start_client

REJOIN_WAIT_S = 600.0  # with no spare in the hostfile, how long a retry waits for the job's hosts
REJOIN_POLL_S = 10.0
BEATS_TIMEOUT_S = 5.0  # for the hosts' last beats when an attempt ends
MAX_SPARE_SETS = 8  # sets of spares a retry checks before it gives up
SIGNAL_TIMEOUT_S = 30.0  # for `launcher.agent signal/status` over an established connection
# The hosts' lease (``launcher.agent.node.NodeAgent._lease``; the zygotes' too): a byte to every node's
# ssh stdin each LEASE_RENEW_S; a node that heard nothing for LEASE_S ends itself. Longer than ssh's own
# detection of a dead link (ServerAliveInterval 5 s × ServerAliveCountMax 3): the launcher gives up on
# a node before that node gives up on the launcher.
LEASE_S = 30.0
LEASE_RENEW_S = 5.0

# ``SshScheduler.replan``: (spec, hosts, the current plan, job dir) -> the plan on those hosts after
# every check of a submit; raises SpecError.
Replan = Callable[[JobSpec, list[str], Plan, Path], Plan]


def agent_command(python: str, action: str, job_id: str, node: int, *extra: str) -> str:
    """``launcher.agent ACTION`` of node ``node`` of ``job_id``, as a remote shell command."""
    return remote(agent_cmd(python, action, "--job", job_id, "--node", str(node), *extra))


class SshAgents(Transport):
    """The supervisor's transport for SSH: one ``ssh host python -m launcher.agent run`` client a node."""

    def __init__(self, plan: Plan, secrets: dict[str, str], record: JobRecord, *, replan: Replan) -> None:
        spec = record.spec()
        opts = spec.options(SshOptions)
        self.plan, self.settings, self.python, self.secrets = plan, ssh_settings(opts), spec.python, secrets
        self.replan = replan
        excluded = copy_excludes(spec, str(plan.facts.get("workdir", "/")), plan.run_dir)
        self.copies = Copies(self.settings, record.dir, plan.run_dir, say, excluded)
        self.failed: set[str] = set()  # hosts a failure was named on: never a spare again
        self.clients: list[subprocess.Popen[bytes]] = []  # whose stdin carries the nodes' lease
        self.lost: set[str] = set()  # hosts whose connection was lost in this attempt
        self.ended: dict[str, NodeStatus] = {}  # host -> its agent's last report, in this attempt
        self.renewer: threading.Thread | None = None
        self.warming = threading.Lock()  # a retry's checks wait for a warm-up of the same spares
        self.zygotes = Zygotes(self.settings, self.python, plan.job_id, record.dir, LEASE_S)
        self.warm = warm_workers(spec)

    def renew(self, record: JobRecord, failed_hosts: Sequence[str]) -> Plan | None:
        """``Transport.renew``: the job's hosts for the next attempt (``_hosts_for_retry``), node k on
        the same host as before unless node k's host failed. On hosts that share no file system with
        this machine, the newest checkpoint goes to every host of the next attempt first (``copies``);
        raises OSError also when it is out of reach (unless ``--allow-start-over``)."""
        self.lost, self.ended = set(), {}  # the next attempt's hosts answer again, or are replaced
        self.copies.settle()
        missing = self.copies.missing()
        if missing is not None and not record.spec().allow_start_over:
            raise OSError(
                "a retry does not start over without its newest checkpoint (--allow-start-over lets it): "
                + missing
            )
        if missing is not None:
            say(f"launcher: warning: going on from an older copy (--allow-start-over): {missing}")
        with self.warming:
            plan = self._hosts_for_retry(record, failed_hosts)
        self.copies.push([n.host for n in self.plan.nodes])
        return plan

    def _hosts_for_retry(self, record: JobRecord, failed_hosts: Sequence[str]) -> Plan | None:
        """The job's Plan with each of its hosts in ``failed_hosts`` replaced by a spare (``_on_spares``),
        never taken again; None when none of ``failed_hosts`` is one of the job's. With no host in the
        hostfile beyond the job's own, the same hosts once they answer again (``_rejoin``). Raises
        OSError naming the hosts that could not be replaced."""
        current = [n.host for n in self.plan.nodes]
        blamed = [h for h in dict.fromkeys(current) if h in failed_hosts]  # in node order
        if not blamed:
            return None
        self.failed.update(blamed)
        pool = hosts_of(record.spec().options(SshOptions))
        free = spares(pool, current, self.failed)
        plan = self._on_spares(record, current, blamed, free)
        if plan is not None:
            self.zygotes.end(set(blamed), wait_s=0.0)  # out of the job: their zygotes go, unwaited for
            return plan
        if spares(pool, current, ()):
            raise OSError(_too_few_spares(blamed, free))
        return self._rejoin(record, current, blamed)

    def _on_spares(
        self, record: JobRecord, current: list[str], blamed: list[str], free: list[str]
    ) -> Plan | None:
        """The job's Plan with the nodes on ``blamed`` hosts moved to spares from ``free`` (in the
        hostfile's order), one spare each: the first set of them, in the order of ``free``, that
        passes every check of a submit (``_replan``) together; each set that fails is said and
        skipped. One check when the first ``len(blamed)`` spares are usable; at most MAX_SPARE_SETS
        (each check probes every host). None: no set passes."""
        for chosen in itertools.islice(itertools.combinations(free, len(blamed)), MAX_SPARE_SETS):
            swap = dict(zip(blamed, chosen, strict=True))
            try:
                return self._replan(record, [swap.get(h, h) for h in current])
            except SpecError as e:
                spare = "spare host" + ("s" if len(chosen) > 1 else "")
                say(f"launcher: {spare} {', '.join(chosen)} cannot take over from {', '.join(blamed)}: {e}")
        return None

    def _rejoin(self, record: JobRecord, current: list[str], blamed: list[str]) -> Plan:
        """The job's Plan on its own hosts once they all pass the checks again (every REJOIN_POLL_S,
        for at most REJOIN_WAIT_S). Raises OSError naming ``blamed`` when they do not in time."""
        deadline = time.monotonic() + REJOIN_WAIT_S
        while True:
            try:
                return self._replan(record, current)
            except SpecError as e:
                if time.monotonic() > deadline:
                    raise OSError(
                        f"no spare host in the hostfile could replace {', '.join(blamed)}, and the job's "
                        f"hosts did not all answer within {REJOIN_WAIT_S:.0f} s: {e}"
                    ) from None
                time.sleep(REJOIN_POLL_S)

    def _replan(self, record: JobRecord, hosts: list[str]) -> Plan:
        """The job's Plan on ``hosts``, after the checks of a submit (probes, parity, workdir, routes,
        port). Raises SpecError."""
        self.plan = self.replan(record.spec(), hosts, self.plan, record.dir)
        return self.plan

    def start(self, node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
        # The secrets travel inside the encrypted channel, read once by the node agent; stdin then
        # carries the lease, stdout the agent's channel: its output and its reports.
        argv = self.settings.argv(node.host, node.shell_command())
        on_report = functools.partial(self._on_report, self.ended, node.host)
        client = start_client(
            argv, record.dir / node.log, self.secrets, keep_stdin=True, channel_of=record.dir,
            on_report=on_report,
        )  # fmt: skip
        self.clients.append(client)
        if self.warm:
            self.zygotes.ensure(node)
        if self.renewer is None:
            self.renewer = threading.Thread(target=self._renew_leases, daemon=True)
            self.renewer.start()
        if node.node_rank == 0 and record.spec().retries:  # each attempt: the spares left for the next
            threading.Thread(target=self._warm_spares, args=(record,), daemon=True).start()
        return client

    def _on_report(self, ended: dict[str, NodeStatus], host: str, report: NodeReport) -> None:
        """``ended``: the dict of the attempt that started this channel (a late report of an earlier
        attempt must not mark a host of the next one)."""
        if isinstance(report, NodeStatus) and not report.running:  # the agent's last: its node is gone
            ended[host] = report
        self.copies.on_report(report)

    def _warm_spares(self, record: JobRecord) -> None:
        """The hostfile's spares (hosts beyond ``--nodes``) made ready before they are needed: they get
        the job's code (``--sync``) and image (pulled), and are probed (with the job's first host as the
        master address they route to), which starts their interpreter and imports torch once (their
        page cache then holds them). A retry that swaps a spare in then finds the copy, the pull and the
        cold imports done: what is left of its checks (``SshScheduler.replan``) is incremental, and a
        spare that cannot take over is named while the job still runs, not at the failure. One line for
        the lot; errors are said, not raised: the retry checks its hosts again whatever happens here."""
        spec = record.spec()
        opts = spec.options(SshOptions)
        current = [n.host for n in self.plan.nodes]
        free = spares(hosts_of(opts), current, self.failed)
        workdir, image = str(self.plan.facts.get("workdir", "/")), self.plan.facts.get("image")
        if not free:
            return
        with self.warming:
            started = time.monotonic()
            try:
                sync(opts, free, workdir, say)
                pinned = str(image) if image else None  # by digest, as every host of the job pulled it
                probes = probe_job_hosts(opts, free, spec.python, pinned, say, master_host=current[0]).probes
            except (SpecError, OSError) as e:
                why = f"not made ready (a retry checks them again): {e}"
                say(f"launcher: spare host(s) {', '.join(free)} {why}")
                return
        found = "; ".join(f"{host}: torch {probe.torch}" for host, probe in probes.items())
        say(f"launcher: spare host(s) ready for a retry in {time.monotonic() - started:.1f} s ({found})")
        for host in free if self.warm else []:  # as node 0 runs, on that host
            self.zygotes.ensure(self.plan.nodes[0].model_copy(update={"host": host}))

    def keep_beats(self, record: JobRecord) -> None:
        """The hosts' last beats into ``JOB/heartbeat/``: from each agent's last report, else asked
        over ssh (a host that does not answer within BEATS_TIMEOUT_S is left out: a lost host must not
        hold up the next attempt); and their last checkpoints copied (``copies``: at most SETTLE_S)."""
        drain_channels(DRAIN_S)  # every agent ended: their last saves and reports are in
        self.copies.settle()
        ended = dict(self.ended)  # a channel still read may add to it
        found = {status.node: status.beats for status in ended.values()}
        if unreported := {n.host for n in self.plan.nodes} - self.lost - set(ended):
            skip = {n.host for n in self.plan.nodes} - unreported
            found |= host_beats(record, BEATS_TIMEOUT_S, skip)
        for node, beats in found.items():
            directory = heartbeat_dir(record.dir, node)
            directory.mkdir(parents=True, exist_ok=True)
            for beat in beats:
                write_beat(directory, beat)

    def _renew_leases(self) -> None:
        """A byte to every live node every LEASE_RENEW_S, for the life of the supervisor."""
        while True:
            time.sleep(LEASE_RENEW_S)
            self.zygotes.renew()
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
        spared = self.copies.processes()  # a checkpoint copy in flight finishes: the retry needs it
        with self.zygotes.lock:  # kept for the next attempt's ranks (none starts in between)
            zygotes = self.zygotes.pids()
            children = psutil.Process().children(recursive=True)
        ending = [p for p in children if p not in spared and p.pid not in zygotes]
        procs.terminate(ending, grace_s)  # ssh clients, masters

    def close(self) -> None:
        """End the zygotes' sessions (``--warm-workers``)."""
        self.zygotes.end()

    def explain(self, node: NodePlan, exit_code: int | None) -> str | None:
        if exit_code != ssh.SSH_FAILED:
            return None
        self.lost.add(node.host)
        return (
            f"the ssh connection to node {node.node_rank} failed or was lost (ssh exit code 255: the host "
            "went down or the network failed)"
        )

    def _signal(self, nodes: list[NodePlan], sig: str, grace_s: float) -> None:
        # A host whose connection was lost is not waited on: its node ends itself (the lease). One
        # whose agent said it ended has nothing left to signal (an agent returns once its whole tree
        # has ended), but for a container, whose removal the signal tries again.
        done = set() if self.plan.facts.get("image") else set(self.ended)
        by_host = {n.host: n for n in nodes if n.host not in self.lost and n.host not in done}
        extra = ("--signal", sig, "--grace-s", f"{grace_s:g}")

        def command(host: str) -> str:
            return agent_command(self.python, "signal", self.plan.job_id, by_host[host].node_rank, *extra)

        for result in ssh.fan_out(self.settings, list(by_host), command, SIGNAL_TIMEOUT_S + grace_s):
            if not result.ok:
                say(f"launcher: could not signal the job on {result.error()}")
            # A KILL answers with the node's status once it is gone: its last beats, and no signal again.
            for report in channel_reports(result.raw)[1] if result.ok else []:
                if isinstance(report, NodeStatus) and not report.running:
                    self.ended.setdefault(result.host, report)


def _too_few_spares(blamed: list[str], free: list[str]) -> str:
    """Why the ``blamed`` hosts could not all be replaced by spares from ``free``."""
    left = f"{len(free)} spare host(s) left in the hostfile ({', '.join(free) or 'none'})"
    if len(free) < len(blamed):
        why = f"{left}: a host a failure named is never taken again"
    else:  # each set of them failed the checks of a submit: said as they ran
        why = f"fewer than {len(blamed)} of the {left} passed the checks of a submit"
    return f"no spare host could replace {', '.join(blamed)} ({len(blamed)} needed): {why}"


def host_status(
    record: JobRecord, timeout_s: float = SIGNAL_TIMEOUT_S, skip: Collection[str] = ()
) -> dict[str, NodeStatus | None]:
    """Each host's ``launcher.agent status`` of its node of the job but those in ``skip``, all asked at
    once (each for at most ``timeout_s`` seconds), as the agent's report on its channel: None where the
    host could not be reached. An answer without that report (an agent of another release) counts as
    a node that does not run."""
    spec = record.spec()
    nodes = {n.host: n.node_rank for n in record.plan().nodes if n.host not in skip}

    def command(host: str) -> str:
        return agent_command(spec.python, "status", record.job_id, nodes[host])

    found: dict[str, NodeStatus | None] = {}
    for result in ssh.fan_out(ssh_settings(spec.options(SshOptions)), list(nodes), command, timeout_s):
        answers = [r for r in channel_reports(result.raw)[1] if isinstance(r, NodeStatus)]
        unreachable = result.returncode is None or result.returncode == ssh.SSH_FAILED
        silent = NodeStatus(node=nodes[result.host], running=False, exit_code=None)
        found[result.host] = answers[-1] if answers else None if unreachable else silent
    return found


def host_beats(
    record: JobRecord, timeout_s: float = SIGNAL_TIMEOUT_S, skip: Collection[str] = ()
) -> dict[int, list[Beat]]:
    """The ranks' latest beats from each host's agent but those in ``skip``, by node rank (one
    connection per host, all at once, each for at most ``timeout_s`` seconds)."""
    nodes = {n.host: n.node_rank for n in record.plan().nodes}
    found = host_status(record, timeout_s, skip)
    return {nodes[host]: status.beats if status is not None else [] for host, status in found.items()}
