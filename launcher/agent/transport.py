"""Starting the node agent from a Plan: its command line (``agent_argv``, rendered into the Plan, so that
``--dry-run`` shows it), and the supervisor's transport for nodes that run as child processes of the
supervisor on this machine (``ChannelAgents``): each agent's output and reports come back over its
channel, as they do from an SSH host. A scheduler defined outside this package (``tests/plugin/``)
gets the hang watch, fail-fast, root cause and retries with these two alone. ``channel_reports``
reads a channel that ended (a short command run through the agent over ssh: the collective
preflight, ``launcher.agent status``).
"""

from __future__ import annotations

import io
import os
import shlex
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import psutil

from gptlaunch.contract import STOP_MARKER
from launcher.agent.copies import MARK
from launcher.job.channel import Demux
from launcher.job.hang import watch_args
from launcher.job.plan import NodePlan
from launcher.job.record import JobRecord, torchelastic_dir
from launcher.job.reports import NodeReport
from launcher.job.spec import JobSpec
from launcher.supervisor import procs
from launcher.supervisor.transport import Transport, start_client


def agent_cmd(python: str, action: str, *args: str) -> list[str]:
    """``python -m launcher.agent ACTION ARGS...``: the node agent's command line (``launcher.agent.cli``)."""
    return [python, "-m", "launcher.agent", action, *args]


def remote(argv: Sequence[str]) -> str:
    """``argv`` as a shell command for a host over ssh. It runs in ``/``: ``python -m`` puts the working
    directory (the login's home) first on sys.path, where another copy of the package may lie."""
    return f"cd / && {shlex.join(argv)}"


def agent_argv(
    python: str,
    spec: JobSpec,
    job_id: str,
    node: int,
    command: Sequence[str],
    *,
    heartbeat_dir: Path | None = None,
    state_dir: Path | None = None,
    lease_s: float = 0.0,
    image_flags: Sequence[str] = (),
    back_flags: Sequence[str] = (),
) -> list[str]:
    """``python -m launcher.agent run`` of node ``node``'s ``command`` with the job's hang watch: the
    ranks beat in ``heartbeat_dir`` (default: the agent's state dir on its host), the agent's files go
    in ``state_dir`` (default: the user's state dir on its host; given, no host log), the lease is
    ``lease_s`` seconds (0: none), ``image_flags`` run it in the job's image
    (``launcher.image.runtime.ImageRun.flags``), ``back_flags`` say what goes back to a launcher that
    does not share the host's files (``back_flags()``)."""
    return [
        *agent_cmd(python, "run", "--job", job_id, "--node", str(node)),
        *([f"--lease-s={lease_s:g}"] if lease_s else []),
        *([f"--heartbeat-dir={heartbeat_dir}"] if heartbeat_dir is not None else []),
        *([f"--state-dir={state_dir}"] if state_dir is not None else []),
        *watch_args(spec.hang, spec.nproc_per_node),
        *image_flags,
        *back_flags,
        "--",
        *command,
    ]


def back_flags(job_dir: Path, node: int, run_dir: Path, exclude: Sequence[str] = ()) -> list[str]:
    """``launcher.agent run``'s flags for a host that may share no file system with the launcher: the
    run dir's checkpoints are copied (but the dirs ``exclude``), the node's error files and the stop
    marker sent back, unless the host sees the launcher's marks (``launcher.agent.copies``)."""
    return [
        f"--copy-dir={run_dir}",
        *(f"--copy-exclude={sub}" for sub in exclude),
        f"--mark={job_dir / MARK}",
        f"--send-back={torchelastic_dir(job_dir, node)}",
        f"--send-back={run_dir / STOP_MARKER}",
    ]


class ChannelAgents(Transport):
    """Nodes whose Plan starts the node agent (``agent_argv``), as child processes of the supervisor;
    ``secrets`` go to each agent's stdin (``start_client``)."""

    def __init__(self, secrets: dict[str, str]) -> None:
        self.secrets = secrets

    def stop(self, agents: list[subprocess.Popen[bytes]]) -> None:
        procs.signal_all([psutil.Process(a.pid) for a in agents if a.poll() is None], signal.SIGTERM)

    def kill(self, job_id: str, grace_s: float) -> None:
        procs.terminate(psutil.Process().children(recursive=True), grace_s)
        procs.sweep(job_id)

    def start(self, node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
        env = os.environ | node.env
        return start_client(
            node.argv, record.dir / node.log, self.secrets, keep_stdin=False, env=env, cwd=node.cwd,
            channel_of=record.dir,
        )  # fmt: skip


def channel_reports(raw: bytes) -> tuple[str, list[NodeReport]]:
    """A node agent's whole channel: (its output as text, its reports in the order sent)."""
    log, found = io.BytesIO(), list[NodeReport]()
    demux = Demux(log, found.append)
    demux.feed(raw)
    demux.close()
    return log.getvalue().decode(errors="replace"), found
