"""The node agent's core: the one process that runs beside a node's torchrun agent under every
scheduler, and does for it what every scheduler needs done.

``NodeAgent.run`` starts the node's command (its torchrun agent, in a container of the job's image when
there is one), then, until it ends:

- forwards SIGTERM/SIGINT to it as SIGTERM (the ranks checkpoint and exit 75), one that came before it
  started included; once its ranks have ended after a stop, the command gets ``KILL_GRACE_S`` to end
  too (``_end_lingering``);
- watches the ranks' heartbeats (the hang watchdog); on a hang it takes their stacks, sends a ``hang``
  report, keeps the ranks until the launcher ends the job (or a bound), then ends them and exits 124
  (``launcher.job.hang.EXIT_HANG``);
- holds the lease (``lease_s``: see ``_lease``);
- once the command has ended: ends what is left of its process tree, removes the container (however
  the agent ends), and returns the exit code (128 + N for signal N, as shells do).

Its invariants: nothing of the node outlives the agent (a child subreaper where the scheduler does not
already end the whole tree); the container of a node is gone before the agent returns; every report
leaves through ``report`` (the job record where the node sees it, the channel where it may not).

How each scheduler starts it: ``python -m launcher.agent run`` (``launcher.agent.cli``) as a child
process of the supervisor (local), over ssh, as a SLURM job step; and the container entry
(``launcher.schedulers.compose.node``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import psutil

from gptlaunch.contract import HEARTBEAT_DIR_ENV, JOB_ID_ENV, job_snapshots
from launcher.agent.memory import MemoryWatch
from launcher.agent.torchrun import FAILED_FD_ENV, fast_exit
from launcher.image.runtime import Container, ImageRun
from launcher.job import reports
from launcher.job.hang import HangReport, HangSpec
from launcher.job.reports import Hang, NodeReport, OomKilled, RankFailed
from launcher.supervisor import procs
from launcher.supervisor.watchdog import Watchdog, end_hung, wait_watching

KILL_GRACE_S = 5.0  # what is left of a node's tree after its torchrun agent ended, before SIGKILL
POLL_S = 0.25  # how often a stopping node's tree is looked at


@dataclass
class NodeAgent:
    node: int
    argv: list[str]
    env: dict[str, str]  # the command's whole environment
    report: Callable[[NodeReport], None]
    say: Callable[[str], None]  # a line for the node log, for people
    watch: tuple[HangSpec, int] | None = None  # the hang watchdog's budgets and ranks (``watch_of``)
    heartbeat_dir: str | None = None  # where the ranks beat (required with ``watch``)
    image: ImageRun | None = None
    container_name: str = ""
    container_mounts: list[str] = field(default_factory=list)
    env_names: list[str] = field(default_factory=list)  # the variables a container gets
    # Where the command's output goes, in chunks, through this agent (e.g. a host log and the channel);
    # None: straight to this agent's own stdout.
    sink: Callable[[bytes], None] | None = None
    subreaper: bool = True
    lease_s: float = 0.0  # 0: no lease
    lease_fd: int = 0
    # Where the node's processes put their reports (``reports.REPORT_DIR_ENV``), forwarded through
    # ``report`` once the command ended: on a host whose files the launcher cannot see.
    forward_dir: str | None = None

    def __post_init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None  # the command, once started
        self.stop_requested = False
        self.cut_off = False  # the lease ran out: the launcher lost this host

    def install_signals(self) -> None:
        """SIGTERM/SIGINT ask the command to stop; SIGHUP (a dropped connection) and SIGUSR2 are not for
        this process. Before anything can find this process to signal it: a stop sent at once is not
        lost."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        # SLURM's warning before a time limit or a preemption reaches every process of a job step:
        # it is for the ranks, the agent outlives it (a handler: the command's default comes back).
        signal.signal(signal.SIGUSR2, lambda signum, frame: None)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        first = not self.stop_requested
        self.stop_requested = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
            if first:
                threading.Thread(target=self._end_lingering, args=(self.child,), daemon=True).start()

    def run(self) -> int:
        """Run the command to its end (see the module docstring); its exit code. Raises OSError when
        it cannot start (a mount that cannot be made, a missing program)."""
        if self.subreaper:
            procs.become_subreaper()
        container = self._container()
        try:
            argv = fast_exit(self.argv, self.env.get("PATH"))  # this interpreter's torchrun: a faster exit
            if container is not None and self.image is not None:  # the image's torchrun, as rendered
                names = [*self.env_names, HEARTBEAT_DIR_ENV, reports.REPORT_DIR_ENV]
                argv = self.image.argv(container, self.argv, names)
            return self._supervise(argv, tells=argv != self.argv and container is None)
        finally:
            if container is not None:  # before the caller records the end: a next attempt reuses the name
                container.remove()

    def _container(self) -> Container | None:
        if self.image is None:
            return None
        container = self.image.container(self.container_name, self.container_mounts)
        container.remove()  # one an earlier run of this node left (its agent SIGKILLed with it)
        return container

    def _supervise(self, argv: list[str], tells: bool) -> int:
        """Run ``argv`` to its end; ``tells``: it is ``launcher.agent.torchrun``, which tells of a
        failed rank on a pipe (``FAILED_FD_ENV``) at once."""
        env = self.env | ({HEARTBEAT_DIR_ENV: self.heartbeat_dir} if self.heartbeat_dir else {})
        env |= {reports.REPORT_DIR_ENV: self.forward_dir} if self.forward_dir else {}
        told, telling = os.pipe() if tells else (-1, -1)
        env |= {FAILED_FD_ENV: str(telling)} if tells else {}
        piped = self.sink is not None
        memory = MemoryWatch()  # the OOM kill counts before any rank runs
        try:
            child = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if piped else None,
                stderr=subprocess.STDOUT if piped else None,
                preexec_fn=procs.die_with_parent,
                pass_fds=(telling,) if tells else (),
            )
        except OSError:
            if tells:
                os.close(told)
            raise
        finally:
            if tells:
                os.close(telling)  # the child's end: EOF once it ends
        self.child = child
        if tells:
            threading.Thread(target=self._report_failed, args=(told,), daemon=True).start()
        memory.start(child.pid)
        if self.stop_requested:
            child.send_signal(signal.SIGTERM)
            threading.Thread(target=self._end_lingering, args=(child,), daemon=True).start()
        pump = None
        if piped:
            pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
            pump.start()
        if self.lease_s > 0:
            threading.Thread(target=self._lease, args=(child,), daemon=True).start()
        watchdog = None
        if self.watch is not None and self.heartbeat_dir:
            budgets, nproc = self.watch
            watchdog = Watchdog(self.node, socket.gethostname(), Path(self.heartbeat_dir), nproc, budgets)
        code, hang = wait_watching(child, watchdog)
        if hang is not None:  # the stacks are taken: report, keep the ranks until released
            code = end_hung(child, hang, self._report_hang, lambda: self.stop_requested)
            procs.terminate(psutil.Process().children(recursive=True), 0.0)  # orphans adopted meanwhile
        else:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)  # the cleanup below must not be cut short
            # Workers the agent left behind. An agent killed by a signal is a failed node: its orphans
            # must not checkpoint and exit as if asked to stop (the job would look stopped, not failed).
            procs.terminate(psutil.Process().children(recursive=True), KILL_GRACE_S if code >= 0 else 0.0)
        memory.stop()
        if code != 0:
            self._report_oom(memory)
        if self.cut_off:  # the job goes on without this host, and without what is in its memory
            self._drop_snapshots()  # every process of the node is gone: no writer races the removal
        if pump is not None:
            pump.join(timeout=5)
        if self.forward_dir:
            for report in reports.read_all(Path(self.forward_dir)):
                self.report(report)
        return code if code >= 0 else 128 - code

    def _report_oom(self, memory: MemoryWatch) -> None:
        """An ``oom`` report when the kernel's OOM killer ended processes while the node ran."""
        killed = memory.killed()
        if killed is not None:
            scope, kills, limit = killed
            host = socket.gethostname()
            self.report(
                OomKilled(
                    node=self.node, host=host, scope=scope, kills=kills, limit_bytes=limit, rss=memory.rss
                )
            )

    def _report_failed(self, fd: int) -> None:
        """A ``rank-failed`` report as soon as the node's torchrun tells of a failed rank on ``fd``;
        nothing when it ends without one."""
        with os.fdopen(fd, "rb") as pipe:
            line = pipe.readline()
        try:
            told = json.loads(line)
            failed = RankFailed(node=self.node, local_rank=told["local_rank"], exit_code=told["exit_code"])
        except (ValueError, KeyError, TypeError):  # EOF: no rank failed
            return
        self.report(failed)

    def _report_hang(self, hang: HangReport) -> None:
        self.report(Hang(node=self.node, hang=hang, time=hang.time))
        self.say(hang.summary())

    def _pump(self, child: subprocess.Popen[bytes]) -> None:
        assert child.stdout is not None and self.sink is not None
        for chunk in iter(lambda: os.read(child.stdout.fileno(), 1 << 16), b""):  # type: ignore[union-attr]
            self.sink(chunk)

    def _end_lingering(self, child: subprocess.Popen[bytes]) -> None:
        """After a stop: once ``child``'s process tree has had no live process for ``KILL_GRACE_S``
        (its ranks checkpointed and exited), end ``child`` if it has not ended. torchrun can outlive
        its ranks for ever: a signal that lands while it closes ranks that had already exited (a peer
        node stopped them first) skips stopping its log-tail threads, and its interpreter then waits
        for them at exit (``PContext.close``, torch 2.13). A container's ranks are not in this tree:
        it waits for the command alone."""
        if self.image is not None:
            return
        idle_since: float | None = None
        while child.poll() is None:
            try:
                tree = psutil.Process(child.pid).children(recursive=True)
                live = any(p.status() != psutil.STATUS_ZOMBIE for p in tree)
            except psutil.Error:  # it ended, or a process of the tree ended while looked at
                live = True  # look again
            if live:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= KILL_GRACE_S:
                self.say(f"agent: the ranks ended but torchrun did not in {KILL_GRACE_S:.0f} s: ending it")
                child.kill()
                return
            time.sleep(POLL_S)

    def _lease(self, child: subprocess.Popen[bytes]) -> None:
        """Kill ``child``'s tree once the launcher's word stops: no byte on ``lease_fd`` for
        ``lease_s`` seconds (a partition, the launcher frozen), or it closed (the launcher or its
        connection is gone). SIGKILL, no checkpoint: the job's next attempt may be writing one. A
        launcher that lost a node has already failed or replaced it: a node that lost its launcher
        must not run on beside the next attempt, nor come back to life when the link does."""
        while child.poll() is None:
            cut_off = not select.select([self.lease_fd], [], [], self.lease_s)[0]
            if cut_off:
                why = (
                    f"no word from the launcher for {self.lease_s:.0f} s (the network or the launcher failed)"
                )
            elif not os.read(self.lease_fd, 4096):
                why = "the connection to the launcher closed"
            else:
                continue
            self.say(f"agent: {why}: ending this node, which the job has failed or replaced")
            self.cut_off = cut_off  # before the kill: the main thread drops the snapshots once it is done
            with contextlib.suppress(psutil.Error):
                procs.signal_all([*psutil.Process(child.pid).children(recursive=True)], signal.SIGKILL)
            child.kill()
            return

    def _drop_snapshots(self) -> None:
        """Remove this host's in-memory snapshots of the job (``gptlaunch.contract.job_snapshots``):
        a host cut off from the launcher is replaced, so nothing of the job may stay in its memory. (A
        closed connection is not enough: the launcher also ends a surviving node that way, whose
        snapshot the next attempt resumes from.)"""
        job_id = self.env.get(JOB_ID_ENV)
        if job_id:
            shutil.rmtree(job_snapshots(job_id), ignore_errors=True)
            self.say("agent: dropped this host's snapshots of the job from memory")
