"""Warm workers for local jobs (``--warm-workers``; ``docs/keeping-alive.md``, "Warm workers"): one
zygote per job (``gptlaunch.warm``), kept across attempts, forks the ranks of every emulated node (a
rank gets its node's environment from its client); one that cannot start leaves every rank cold, and
says why in the job's ``warm.log``.

The zygote's environment lacks the job id (``JOB_ID_ENV``): the sweep between attempts, which ends
every process marked with it, must leave the zygote alone. Its forked ranks are its children, so
``kill`` still reaches them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil

from gptlaunch.contract import JOB_ID_ENV
from launcher.agent.private import UnsafeDirError, private_dir
from launcher.agent.transport import ChannelAgents
from launcher.job.plan import NodePlan
from launcher.job.record import JobRecord
from launcher.supervisor import procs

LOG = "warm.log"  # the zygote's output, in the job dir


def zygote_socket(job_id: str) -> Path:
    """Where the zygote of ``job_id`` listens: a short path whatever the job's name (a Unix socket's
    is at most 107 bytes), in a directory only this user may enter (``private_dir``): another user's
    could hold a socket of theirs, which would receive the ranks' environment and streams."""
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"gptlaunch-warm-{digest}" / "z.sock"


class WarmAgents(ChannelAgents):
    """``ChannelAgents`` whose ranks are forked from one zygote per job, run by ``python``."""

    def __init__(self, secrets: dict[str, str], python: str, job_id: str) -> None:
        super().__init__(secrets)
        self.python, self.job_id = python, job_id
        self.zygote: subprocess.Popen[bytes] | None = None

    def start(self, node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
        if self.zygote is None or self.zygote.poll() is not None:
            try:
                self.zygote = self._start_zygote(node, record)
            except (OSError, UnsafeDirError) as e:  # the job runs cold: slower, never worse
                with open(record.dir / LOG, "a") as log:
                    print(f"gptlaunch.warm: no zygote, the ranks start cold: {e}", file=log)
        return super().start(node, record)

    def _start_zygote(self, node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
        sock = zygote_socket(self.job_id)
        private_dir(sock.parent)
        env = {k: v for k, v in (os.environ | node.env).items() if k != JOB_ID_ENV}
        with open(record.dir / LOG, "ab") as log:
            return subprocess.Popen(
                [self.python, "-m", "gptlaunch.warm", "serve", str(sock)],
                env=env, cwd=node.cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=procs.die_with_parent,
            )  # fmt: skip

    def kill(self, job_id: str, grace_s: float) -> None:
        """End every process of the job but the zygote (its ranks included)."""
        tree = psutil.Process().children(recursive=True)
        procs.terminate([p for p in tree if self.zygote is None or p.pid != self.zygote.pid], grace_s)
        procs.sweep(job_id)

    def close(self) -> None:
        """End the zygote and remove its socket."""
        if self.zygote is not None:
            with contextlib.suppress(psutil.Error):
                procs.terminate([psutil.Process(self.zygote.pid)], 2.0)
            self.zygote.wait()
        shutil.rmtree(zygote_socket(self.job_id).parent, ignore_errors=True)
