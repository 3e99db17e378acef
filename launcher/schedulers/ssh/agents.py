"""The supervisor's transport for SSH (``SshAgents``): one ``ssh host python -m launcher.agent run``
client a node, its stdin the node's lease and its stdout the agent's channel; ``launcher.agent
signal`` over ssh to stop or end a node; a spare host in place of a failed one for a retry; and, for
hosts that share no file system with the launcher, the checkpoint copies (``copies``).
"""

from __future__ import annotations

import functools
import shlex
import subprocess
import threading
import time
from typing import TYPE_CHECKING

import psutil

from gptlaunch.contract import write_beat
from launcher.agent.transport import channel_reports
from launcher.job.console import say
from launcher.job.hang import heartbeat_dir
from launcher.job.plan import NodePlan, Plan
from launcher.job.record import JobRecord
from launcher.job.reports import NodeReport, NodeStatus
from launcher.job.retry import spares
from launcher.job.spec import SpecError
from launcher.job.torchrun import copy_excludes
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.copies import Copies
from launcher.schedulers.ssh.hosts import hosts_of
from launcher.schedulers.ssh.options import SshOptions
from launcher.schedulers.ssh.warm import warm_spares
from launcher.schedulers.ssh.zygotes import Zygotes
from launcher.supervisor import procs
from launcher.supervisor.transport import DRAIN_S, ChildAgents, drain_channels, start_client

if TYPE_CHECKING:
    from launcher.schedulers.ssh.scheduler import SshScheduler

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


def agent_command(python: str, action: str, job_id: str, node: int, *extra: str) -> str:
    """``launcher.agent ACTION`` of node ``node`` of ``job_id``, as a remote shell command."""
    argv = [python, "-m", "launcher.agent", action, "--job", job_id, "--node", str(node), *extra]
    return f"cd / && {shlex.join(argv)}"


class SshAgents(ChildAgents):
    """The supervisor's transport for SSH: one ``ssh host python -m launcher.agent run`` client a node."""

    def __init__(
        self,
        plan: Plan,
        settings: ssh.SshSettings,
        python: str,
        secrets: dict[str, str],
        scheduler: SshScheduler,
        record: JobRecord,
    ) -> None:
        self.plan, self.settings, self.python, self.secrets = plan, settings, python, secrets
        self.scheduler = scheduler
        excluded = copy_excludes(record.spec(), str(plan.facts.get("workdir", "/")), plan.run_dir)
        self.copies = Copies(settings, record.dir, plan.run_dir, say, excluded)
        self.failed: set[str] = set()  # hosts a failure was named on: never a spare again
        self.clients: list[subprocess.Popen[bytes]] = []  # whose stdin carries the nodes' lease
        self.lost: set[str] = set()  # hosts whose connection was lost in this attempt
        self.ended: dict[str, NodeStatus] = {}  # host -> its agent's last report, in this attempt
        self.renewer: threading.Thread | None = None
        self.warming = threading.Lock()  # a retry's checks wait for a warm-up of the same spares
        self.zygotes = Zygotes(settings, python, plan.job_id, record.dir, LEASE_S)
        self.warm = record.spec().options(SshOptions).warm_workers

    def renew(self, record: JobRecord, failed_host: str | None) -> Plan | None:
        """For a retry: the first spare of the hostfile (hosts beyond ``--nodes``) that passes every
        check of a submit, in place of ``failed_host``; with none, the same hosts once they all answer
        again (every REJOIN_POLL_S, for at most REJOIN_WAIT_S). The new Plan (None: ``failed_host``
        is not one of the job's). On hosts that share no file system with this machine, the newest
        checkpoint goes to every host of the next attempt first (``copies``). Raises OSError when no
        set of hosts can run the next attempt, or when the newest checkpoint is out of reach (unless
        ``--allow-start-over``)."""
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
            plan = self._hosts_for_retry(record, failed_host)
        self.copies.push([n.host for n in self.plan.nodes])
        return plan

    def _hosts_for_retry(self, record: JobRecord, failed_host: str | None) -> Plan | None:
        current = [n.host for n in self.plan.nodes]
        if failed_host not in current:
            return None
        spec = record.spec()
        opts = spec.options(SshOptions)
        self.failed.add(failed_host)
        for spare in spares(hosts_of(opts), current, self.failed):
            try:
                plan = self._replan(record, [spare if h == failed_host else h for h in current])
                self.zygotes.end({failed_host}, wait_s=0.0)  # out of the job: its zygote goes, unwaited for
                return plan
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
        spec = record.spec()
        current = [n.host for n in self.plan.nodes]
        free = spares(hosts_of(spec.options(SshOptions)), current, self.failed)
        workdir, image = str(self.plan.facts.get("workdir", "/")), self.plan.facts.get("image")
        ref = str(image) if image else None  # pinned by digest, as every host of the job pulled it
        with self.warming:
            ready = warm_spares(spec.options(SshOptions), free, current, spec.python, workdir, ref, say)
        for host in free if ready and self.warm else []:  # as node 0 runs, on that host
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
            found |= self.scheduler.heartbeats(record, BEATS_TIMEOUT_S, skip=skip)
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
