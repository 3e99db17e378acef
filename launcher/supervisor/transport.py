"""How the supervisor reaches its node agents: the ``Transport`` each scheduler gives it, how one
starts (``start_client``), and a job's secret variables on its stdin, read on the node by
``receive_secrets``.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from launcher.job import channel, reports
from launcher.job.plan import NodePlan, Plan
from launcher.job.record import JobRecord, Outcome
from launcher.supervisor import procs


class Transport(ABC):
    """How the supervisor starts, stops and explains the node agents of one scheduler. The hooks that
    only some schedulers need (``close`` to ``requeue``) do nothing unless overridden."""

    @abstractmethod
    def start(self, node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
        """Start ``node``'s agent, its output appended to the node log. Raises OSError."""

    @abstractmethod
    def stop(self, agents: list[subprocess.Popen[bytes]]) -> None:
        """Ask every running agent to stop: its ranks checkpoint and exit."""

    @abstractmethod
    def kill(self, job_id: str, grace_s: float) -> None:
        """End every process of the job now: SIGTERM, SIGKILL after ``grace_s`` seconds."""

    def close(self) -> None:  # noqa: B027 - a hook: nothing to do by default
        """Once the job has ended and ``kill`` ran: end what the transport kept across attempts
        (default: nothing is kept)."""

    def explain(self, node: NodePlan, exit_code: int | None) -> str | None:
        """What an agent's exit code means for this transport (e.g. ssh's 255: the connection was lost),
        or None when it is the agent's own (default: always)."""
        return None

    def keep_beats(self, record: JobRecord) -> None:  # noqa: B027 - a hook: nothing to do by default
        """Copy the ranks' last heartbeats into the job record where they are kept elsewhere (SSH: on
        the hosts), so that the attempt's step and goodput can be read from the record (default:
        nothing to do, the ranks beat in the job record)."""

    def renew(self, record: JobRecord, failed_hosts: Sequence[str]) -> Plan | None:
        """Make the nodes startable again after ``kill``, for a retry: containers anew, or a spare in
        place of each of ``failed_hosts`` (every host the failure blamed: the root cause's, each hang
        suspect's, each one a health gate named; may be empty); a new Plan when the hosts change, else
        None. Raises OSError when the next attempt cannot run (too few spares: it says which hosts),
        NewAllocation when it runs in a new allocation (``requeue``). Default: nothing to do, the
        agents are processes started anew on the same nodes."""
        return None

    def refused(self, record: JobRecord) -> reports.Refused | None:
        """A check before training that ran before this controller (SLURM's batch steps: the health
        gate) and refused nodes of its first attempt, which then starts no agent: its outcome is that
        refusal's. None on every later call (default: always, the checks ran before this controller
        started, in ``launcher submit``)."""
        return None

    def requeue(
        self, record: JobRecord, outcome: Outcome, excluded: Sequence[str], wait_s: float
    ) -> str | None:
        """Hand the job back to its scheduler, to run again in a new allocation, after the attempt that
        ended with ``outcome``: a failure that ``renew`` could not retry here (NewAllocation), which
        runs without the hosts ``excluded`` after ``wait_s`` seconds, or a stop the scheduler asked for
        (SLURM's warning before a time limit or a preemption). The next controller resumes the job,
        so this one ends without recording an end. What to say; None where the scheduler does not
        (the job ends here; the default: a job has no allocation to come back to)."""
        return None


class NewAllocation(OSError):
    """``Transport.renew``: the next attempt cannot run in this allocation (no spare left), but in a
    new one, which ``Transport.requeue`` asks the scheduler for."""


def start_client(
    argv: list[str],
    log: Path,
    secret_env: dict[str, str],
    *,
    keep_stdin: bool,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    channel_of: Path | None = None,
    on_report: Callable[[reports.NodeReport], None] | None = None,
) -> subprocess.Popen[bytes]:
    """Start a node's client process (``ssh host ...``, ``docker start --attach ...``) in ``env`` and
    ``cwd`` (None: ours): its output appended to ``log``, the secret variables written to its stdin as
    one JSON line (never on a command line, a disk or in a log), stdin then closed unless
    ``keep_stdin``. With ``channel_of`` (a job directory), its stdout is an agent's channel
    (``launcher.job.channel``): output to ``log``, reports into that job record and to ``on_report``.
    Its own session, killed with the supervisor. Raises OSError."""
    with open(log, "ab") as out:
        client = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=out if channel_of is None else subprocess.PIPE,
            stderr=subprocess.STDOUT if channel_of is None else out,
            start_new_session=True,
            preexec_fn=procs.die_with_parent,
        )
    if channel_of is not None:
        assert client.stdout is not None
        pump = threading.Thread(
            target=channel.pump, args=(client.stdout, log, channel_of, on_report), daemon=True
        )
        pump.start()
        _CHANNELS[client.pid] = pump
    assert client.stdin is not None
    # A client that already exited is not an error here: its exit code and log say why it failed.
    with contextlib.suppress(OSError):
        client.stdin.write((json.dumps(secret_env) + "\n").encode())
        client.stdin.flush()
        if not keep_stdin:
            client.stdin.close()
    return client


def receive_secrets(timeout_s: float | None = None) -> dict[str, str] | None:
    """The node side of ``start_client``'s secrets: the line from this process's stdin (the SSH host
    agent's, the compose container entry's), read once, whose variables go to torchrun's environment
    only. {} when stdin is empty, a terminal or not JSON; None when ``timeout_s`` seconds pass with
    nothing to read (a writer-less stdin: run by hand)."""
    if sys.stdin is None or sys.stdin.isatty():
        return {}
    if timeout_s is not None and not select.select([sys.stdin], [], [], timeout_s)[0]:
        return None
    line = sys.stdin.readline()
    try:
        data = json.loads(line) if line.strip() else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


DRAIN_S = 5.0  # after the agents ended, how long their channels get to deliver the rest
_CHANNELS: dict[int, threading.Thread] = {}  # the agents' channels this supervisor reads, by client pid


def drain_channels(timeout_s: float, pids: Collection[int] | None = None) -> None:
    """Wait (at most ``timeout_s`` in all) until the channels of agents that ended (of the clients
    ``pids``, default all) are read to their end: a report sent just before its agent exited is in the
    job record after this."""
    deadline = time.monotonic() + timeout_s
    for pid, pump in list(_CHANNELS.items()):
        if pids is None or pid in pids:
            pump.join(max(0.0, deadline - time.monotonic()))
            if not pump.is_alive():
                del _CHANNELS[pid]
