"""Warm workers on SSH hosts (``--warm-workers``): one zygote (``gptlaunch.warm``) per job and host,
so that a retry's ranks are forked from a process that has imported torch instead of starting cold.

Each zygote is an ssh session, ``python -m gptlaunch.warm serve @NAME --until-stdin-closes``, over a
connection of its own (the supervisor ends the shared master connections with each attempt, and the
sessions they carry with them). The supervisor starts it beside the host's first node agent (and on
the spares once they are made ready) and keeps it across attempts. Its life is its session's:
closing the session's stdin (``end``), the ssh client dying with the supervisor, or the connection
dropping ends the zygote once its forked ranks have ended (their clients, under the node agent, end
them). A session that ended is started again with the host's next node. The zygote listens on an
abstract socket (``@NAME``), which belongs to the host's network namespace: hosts that share a
``/tmp`` each reach their own, and the clients check by SO_PEERCRED that it is this user's.

The zygote's environment is the node's, less the job id (``JOB_ID_ENV``): a sweep of the job's
processes on the host must leave it. Its output goes to ``warm-HOST.log`` in the job dir.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import subprocess
import threading
import time
from pathlib import Path

from gptlaunch.contract import JOB_ID_ENV
from launcher.job.plan import NodePlan
from launcher.schedulers.ssh.client import SshSettings
from launcher.supervisor import procs

END_WAIT_S = 5.0  # for a zygote's ssh session to end once its stdin is closed


def zygote_name(job_id: str) -> str:
    """The abstract socket (``@NAME``) of ``job_id``'s zygote on each host."""
    return "@gptlaunch-warm-" + hashlib.sha256(job_id.encode()).hexdigest()[:16]


class Zygotes:
    """The job's zygote sessions, one per host, started by one thread that lives as long as the
    supervisor (an ssh client is started to die with the thread that started it)."""

    def __init__(self, settings: SshSettings, python: str, job_id: str, log_dir: Path) -> None:
        self.settings, self.python, self.job_id, self.log_dir = settings, python, job_id, log_dir
        self.sessions: dict[str, subprocess.Popen[bytes]] = {}
        self.lock = threading.Lock()
        self.wanted: queue.SimpleQueue[NodePlan] = queue.SimpleQueue()
        self.starter: threading.Thread | None = None

    def ensure(self, node: NodePlan) -> None:
        """Have a zygote run on ``node.host`` with ``node``'s directory and environment, unless one
        runs there already. Returns at once: a rank that starts before it is ready starts cold."""
        if self.starter is None:
            self.starter = threading.Thread(target=self._start_wanted, daemon=True)
            self.starter.start()
        self.wanted.put(node)

    def _start_wanted(self) -> None:
        while True:
            node = self.wanted.get()
            with self.lock:
                session = self.sessions.get(node.host)
                if session is None or session.poll() is not None:
                    self.sessions[node.host] = self._start(node)

    def _start(self, node: NodePlan) -> subprocess.Popen[bytes]:
        argv = [
            self.python,
            "-m",
            "gptlaunch.warm",
            "serve",
            zygote_name(self.job_id),
            "--until-stdin-closes",
        ]
        env = {k: v for k, v in node.env.items() if k != JOB_ID_ENV}
        command = node.model_copy(update={"argv": argv, "env": env}).shell_command()
        with open(self.log_dir / f"warm-{node.host}.log", "ab") as log:
            return subprocess.Popen(
                self.settings.argv(node.host, command, shared=False), stdin=subprocess.PIPE, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=procs.die_with_parent,
            )  # fmt: skip

    def pids(self) -> set[int]:
        """The local ssh clients of the sessions: a kill of the attempt's processes spares them."""
        with self.lock:
            return {s.pid for s in self.sessions.values() if s.poll() is None}

    def end(self, hosts: set[str] | None = None, wait_s: float = END_WAIT_S) -> None:
        """Close the sessions on ``hosts`` (default: all), and kill the ssh clients of those that did not
        end within ``wait_s`` (a host cut off never answers; its zygote sees the session drop)."""
        with self.lock:
            ending = {h: s for h, s in self.sessions.items() if hosts is None or h in hosts}
            for host, session in ending.items():
                del self.sessions[host]
                with contextlib.suppress(OSError):
                    assert session.stdin is not None
                    session.stdin.close()
        deadline = time.monotonic() + wait_s
        for session in ending.values():
            try:
                session.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                session.kill()
                session.wait()
