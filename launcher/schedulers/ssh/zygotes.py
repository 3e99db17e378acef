"""Warm workers on SSH hosts (``--warm-workers``): one zygote (``gptlaunch.warm``) per job and host,
``python -m gptlaunch.warm serve @NAME --lease-s S``, held by the node agents' lease; how it lives and
why its abstract socket: docs/keeping-alive.md, "Warm workers". Each is an ssh session over a
connection of its own: the supervisor ends the shared master connections with each attempt, and the
sessions they carry with them. A session that ended is started again with the host's next node. The
zygote's environment is the node's, less the job id (as a local job's:
``launcher.schedulers.local.warm``). Its output goes to ``warm-HOST.log`` in the job dir.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from pathlib import Path

from gptlaunch.contract import JOB_ID_ENV
from launcher.job.plan import NodePlan
from launcher.job.torchrun import zygote_serve
from launcher.schedulers.ssh.client import SshSettings

END_WAIT_S = 5.0  # for the zygotes' ssh sessions to end once their stdin is closed


class Zygotes:
    """The job's zygote sessions, one per host. ``lock`` (reentrant) is held while a session starts:
    a caller that must tell the sessions' ssh clients from other processes takes it around both."""

    def __init__(
        self, settings: SshSettings, python: str, job_id: str, log_dir: Path, lease_s: float
    ) -> None:
        self.settings, self.log_dir = settings, log_dir
        self.argv = [python, *zygote_serve(job_id), "--lease-s", f"{lease_s:g}"]
        self.sessions: dict[str, subprocess.Popen[bytes]] = {}
        self.lock = threading.RLock()
        self.closed = False  # the job ended: no zygote starts any more

    def ensure(self, node: NodePlan) -> None:
        """Have a zygote run on ``node.host`` with ``node``'s directory and environment, unless one runs
        there already. Returns at once: a rank that starts before it is ready starts cold, and so do
        all of them if it cannot start (said in the host's log)."""
        log_path = self.log_dir / f"warm-{node.host}.log"
        env = {k: v for k, v in node.env.items() if k != JOB_ID_ENV}
        command = node.model_copy(update={"argv": self.argv, "env": env}).shell_command()
        with self.lock:
            session = self.sessions.get(node.host)
            if self.closed or (session is not None and session.poll() is None):
                return
            try:
                with open(log_path, "ab") as log:
                    self.sessions[node.host] = subprocess.Popen(
                        self.settings.argv(node.host, command, shared=False), stdin=subprocess.PIPE,
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )  # fmt: skip
            except OSError as e:
                with contextlib.suppress(OSError), open(log_path, "a") as log:
                    print(f"launcher: no zygote on {node.host}, its ranks start cold: {e}", file=log)

    def renew(self) -> None:
        """A byte to every zygote's stdin: its lease."""
        with self.lock:
            sessions = list(self.sessions.values())
        for session in sessions:
            with contextlib.suppress(OSError, ValueError):  # ended (or closed): a next node starts another
                assert session.stdin is not None
                session.stdin.write(b"\n")
                session.stdin.flush()

    def pids(self) -> set[int]:
        """The sessions' local ssh clients (hold ``lock`` while telling them from other processes)."""
        with self.lock:
            return {s.pid for s in self.sessions.values() if s.poll() is None}

    def end(self, hosts: set[str] | None = None, wait_s: float = END_WAIT_S) -> None:
        """Close the sessions on ``hosts`` (default: all, and no zygote starts after), and kill the ssh
        clients of those that did not end within ``wait_s`` (a host cut off never answers: its zygote's
        lease runs out)."""
        with self.lock:
            self.closed = self.closed or hosts is None
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
