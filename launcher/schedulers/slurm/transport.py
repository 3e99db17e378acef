"""The controller's transport inside a SLURM allocation (``SrunAgents``): each node's agent (as the Plan
renders it) is a job step of its own, ``srun --nodes=1 --ntasks=1 --nodelist=HOST``, started from the
controller on the allocation's first node; srun relays the step's stdout (the agent's channel) and its
stdin. What srun does with a step's signals, and so why a stop or a kill is the agent's own ``signal``
action run as an overlapping step, then SIGTERM to the srun clients (which return once SLURM has ended
their steps), and how spares and requeues replace failed nodes: docs/contributors/architecture.md,
"SLURM: the controller inside the allocation".
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
from collections.abc import Collection, Sequence
from pathlib import Path
from types import FrameType

import psutil

from gptlaunch.contract import EXIT_CHECKPOINTED, FIRST_HOST_ENV
from launcher.agent.transport import agent_cmd
from launcher.job import reports
from launcher.job.failures import stop_marker
from launcher.job.plan import NodePlan, Plan
from launcher.job.record import JobRecord, Outcome, agent_dir
from launcher.job.retry import spares
from launcher.schedulers.slurm.image import SlurmImage
from launcher.schedulers.slurm.options import SlurmOptions
from launcher.supervisor import procs
from launcher.supervisor.transport import NewAllocation, Transport, start_client

SIGNAL_TIMEOUT_S = 30.0  # for an agent's ``signal`` step: srun's start and a Python's
STEP_END_S = 40.0  # SLURM's KillWait (30 s by default) and the time srun takes to see its step gone


def step_argv(host: str, *extra: str) -> list[str]:
    """srun's start of a one-task step on ``host`` of the job's allocation."""
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--unbuffered", *extra]


def allocation_hosts() -> list[str]:
    """The allocation's hosts, in its order (``scontrol show hostnames $SLURM_JOB_NODELIST``)."""
    return _scontrol("show", "hostnames", os.environ["SLURM_JOB_NODELIST"]).split()


def placed(plan: Plan, hosts: Sequence[str]) -> Plan:
    """``plan`` with node k on ``hosts[k]``."""
    nodes = [n.model_copy(update={"host": h}) for n, h in zip(plan.nodes, hosts, strict=True)]
    return plan.model_copy(update={"nodes": nodes})


def _scontrol(*args: str) -> str:
    """scontrol's output. Raises subprocess.CalledProcessError with scontrol's error."""
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60, check=True).stdout


def on_spares(allocation: Sequence[str], current: Sequence[str], failed: Collection[str]) -> list[str]:
    """The next attempt's hosts in the ``allocation`` (its order): ``current`` (node k's host at k)
    with each host in ``failed`` replaced by a spare, the first ones of the allocation that run no
    node and never ``failed``. Raises NewAllocation, naming the failed hosts, when too few are left."""
    blamed = [h for h in current if h in failed]
    free = spares(allocation, current, failed)
    if len(free) < len(blamed):
        raise NewAllocation(f"no spare node left in the allocation for {', '.join(blamed)}")
    swap = dict(zip(blamed, free, strict=False))
    return [swap.get(h, h) for h in current]


class SrunAgents(Transport):
    """The controller's transport in a SLURM allocation: one srun step a node (see the module)."""

    def __init__(
        self, plan: Plan, record: JobRecord, hosts: list[str], since: float, image: SlurmImage | None
    ) -> None:
        """``hosts``: the allocation's, in its order; ``since``: when this controller started;
        ``image``: where the agents run in the job's image (the Plan says how, but for pyxis's srun
        options)."""
        spec = record.spec()
        self.plan, self.job_dir, self.hosts, self.since = plan, record.dir, hosts, since
        self.max_requeues = spec.options(SlurmOptions).max_requeues
        self.python = image.python if image else spec.python  # the agents'
        self.srun_args = image.srun_args() if image else []
        self.image = image
        self.failed: set[str] = set()  # hosts a failure named: never used again in this allocation
        self.clients: dict[int, subprocess.Popen[bytes]] = {}  # node rank -> its srun, this attempt
        self.checked = False  # whether the gate's refusal was asked for (``refused``)
        signal.signal(signal.SIGUSR2, self._relay)

    def _relay(self, signum: int, frame: FrameType | None) -> None:
        """SLURM's warning sent to the batch step (``scancel --signal=USR2 --full``; the one before a
        time limit goes to the steps themselves): to every srun client, which passes it on to every
        process of its step. The ranks checkpoint and stop; the agents outlive it."""
        for client in list(self.clients.values()):
            if client.poll() is None:
                client.send_signal(signum)

    def start(self, node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
        # Every node meets node 0's rendezvous, wherever a retry put it (``{{first_host}}``).
        env = os.environ | node.env | {FIRST_HOST_ENV: self.plan.nodes[0].host}
        argv = [*step_argv(node.host, *self.srun_args), *node.argv]
        client = start_client(
            argv, record.dir / node.log, {}, keep_stdin=False, env=env, cwd=node.cwd, channel_of=record.dir
        )
        self.clients[node.node_rank] = client
        return client

    def stop(self, agents: list[subprocess.Popen[bytes]]) -> None:
        """The agents' ``signal --signal TERM`` on their nodes: each relays it to its ranks."""
        self._signal("TERM", 0.0)

    def kill(self, job_id: str, grace_s: float) -> None:
        """The agents' ``signal --signal KILL`` on their nodes (SIGTERM, SIGKILL after ``grace_s``: a
        survivor keeps its last state in memory meanwhile), then SIGTERM to every srun client: SLURM
        ends their steps, every process of them."""
        self._signal("KILL", grace_s)
        procs.terminate(psutil.Process().children(recursive=True), STEP_END_S)
        self.clients = {}

    def _signal(self, sig: str, grace_s: float) -> None:
        """``launcher.agent signal`` on the node of every agent still running, at once; each step
        overlaps the agent's, which holds the node."""
        signals = [
            subprocess.Popen(
                self._signal_argv(node, sig, grace_s), stdout=subprocess.DEVNULL, start_new_session=True
            )
            for node in self.plan.nodes
            if (client := self.clients.get(node.node_rank)) is not None and client.poll() is None
        ]
        for step in signals:
            try:
                step.wait(SIGNAL_TIMEOUT_S + grace_s)
            except subprocess.TimeoutExpired:
                step.kill()

    def _signal_argv(self, node: NodePlan, sig: str, grace_s: float) -> list[str]:
        agent = agent_cmd(self.python, "signal", "--job", self.plan.job_id)
        agent += ["--node", str(node.node_rank), "--signal", sig, f"--grace-s={grace_s:g}"]
        agent.append(f"--state-dir={agent_dir(self.job_dir)}")
        return [
            *step_argv(node.host, "--overlap", *self.srun_args),
            *(self.image.wrap(agent) if self.image else agent),
        ]

    def refused(self, record: JobRecord) -> reports.Refused | None:
        """The health gate's refusal of this allocation's first nodes, which the batch script judged
        before this controller started (since the job's last attempt ended); once."""
        if self.checked:
            return None
        self.checked = True
        status = record.status()
        found = reports.read(
            record.dir, reports.Refused, max([status.created_at, *(a.ended_at for a in status.attempts)])
        )
        return found[-1] if found else None

    def renew(self, record: JobRecord, failed_hosts: Sequence[str]) -> Plan | None:
        """Each of the job's hosts in ``failed_hosts`` replaced by a spare node of the allocation
        (``on_spares``), and never used again in it; None when none is one of the job's. Raises
        NewAllocation when too few spares are left: the job is then requeued without them."""
        current = [n.host for n in self.plan.nodes]
        self.failed.update(h for h in current if h in failed_hosts)
        hosts = on_spares(self.hosts, current, self.failed)
        if hosts == current:
            return None
        self.plan = placed(self.plan, hosts)
        return self.plan

    def requeue(
        self, record: JobRecord, outcome: Outcome, excluded: Sequence[str], wait_s: float
    ) -> str | None:
        """SLURM requeues the job: after a failure with no spare left, without ``excluded``; after the
        ranks checkpointed on SLURM's warning signal (SIGUSR2: a time limit or a preemption), as
        long as ``max_requeues`` allows."""
        job_id = os.environ["SLURM_JOB_ID"]
        if outcome.exit_code != EXIT_CHECKPOINTED:
            # SLURM refuses to change the nodes of a running job: it is first made pending and held,
            # which also ends this allocation (SIGTERM to the batch step, which this process ignores
            # for the few seconds it takes); it then starts again after ``wait_s`` seconds.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by scontrol
            _scontrol("requeuehold", job_id)
            why = ""
            try:
                start = f"StartTime=now+{math.ceil(wait_s)}"
                _scontrol("update", f"JobId={job_id}", f"ExcNodeList={','.join(excluded)}", start)
            except subprocess.CalledProcessError as e:  # the job then requeues without the exclusion
                why = f" (could not exclude them: {e.stderr.strip() or e})"
            _scontrol("release", job_id)
            return f"requeued SLURM job {job_id} without {', '.join(excluded)}{why}"
        marker = stop_marker(Path(self.plan.run_dir), self.since, record.dir)
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        if marker is None or marker.signal != "SIGUSR2" or restarts >= self.max_requeues:
            return None
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue ends this allocation
        _scontrol("requeue", job_id)
        return (
            f"checkpoint of step {marker.step} saved on SLURM's warning; requeued "
            f"(restart {restarts + 1} of at most {self.max_requeues})"
        )
