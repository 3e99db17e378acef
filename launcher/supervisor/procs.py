"""Finding and stopping every process of a job, orphans included.

torchrun starts each worker in a new session, so signalling an agent's process group does not reach
its workers, and a worker whose agent died is re-parented away from the launcher. Two safety nets:
the launcher makes itself a child subreaper (orphans re-parent to it), and every process of a job
carries ``GPTLAUNCH_JOB_ID`` in its environment, so a sweep finds them wherever they are. And so that
a SIGKILLed supervisor leaves no orphan, its agents ask the kernel for SIGTERM when it dies
(``PR_SET_PDEATHSIG``): they forward it to their workers, which checkpoint and exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
from collections.abc import Iterable

import psutil

from gptlaunch.contract import JOB_ID_ENV
from launcher.job.record import ProcessRef

# Stop requests: Ctrl-C, `launcher cancel` (SIGTERM), the terminal closing (SIGHUP).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the environment sweep is the only net
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)


def become_subreaper() -> None:
    """Linux: adopt orphaned descendants, so none escapes ``psutil.Process().children()``."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: have the kernel send ``sig`` to this process when the thread that created it exits, even
    by SIGKILL. Call it in the child (e.g. as a Popen ``preexec_fn``) from a parent's main thread."""
    parent = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


def process_ref(pid: int | None = None) -> ProcessRef:
    """A reference to process ``pid`` (default: this one) that a reused pid cannot impersonate."""
    proc = psutil.Process(pid)
    return ProcessRef(pid=proc.pid, started=proc.create_time())


def job_processes(job_id: str, marks: dict[str, str] | None = None) -> list[psutil.Process]:
    """Live processes on this machine whose environment marks them as part of ``job_id`` (and holds
    every variable of ``marks``: e.g. a node's). One whose environment cannot be read is not."""
    wanted = {JOB_ID_ENV: job_id} | (marks or {})
    return [
        proc
        for proc in psutil.process_iter(["environ"], ad_value={})
        if proc.pid != os.getpid() and wanted.items() <= proc.info["environ"].items()
    ]


def processes(pids: Iterable[int]) -> list[psutil.Process]:
    """The live processes among ``pids``."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            found.append(psutil.Process(pid))
    return found


def signal_all(procs: Iterable[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            proc.send_signal(sig)


def terminate(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM ``procs``, wait up to ``grace_s`` seconds for them to exit, SIGKILL the rest."""
    signal_all(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    signal_all(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)


def kill_tree(pid: int) -> None:
    """End ``pid`` and every descendant now: SIGTERM, then SIGKILL at once (a hung node's ranks, once
    their stacks are taken: a stopped process never acts on the SIGTERM)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        terminate([root, *root.children(recursive=True)], 0.0)


def sweep(job_id: str, grace_s: float = 2.0) -> None:
    """Stop every remaining process of ``job_id`` (SIGTERM, then SIGKILL)."""
    terminate(job_processes(job_id), grace_s)


def alive(ref: ProcessRef | None) -> bool:
    """Whether the process ``ref`` may still be running: True for a process of another host (its
    jobs root is shared: that host's launcher tells), False for a reused pid (another create time) or
    a zombie, which is reaped when it is our own child (the attached supervisor)."""
    if ref is None:
        return False
    if ref.host != socket.gethostname():
        return True
    try:
        proc = psutil.Process(ref.pid)
        if abs(proc.create_time() - ref.started) >= 1e-3:
            return False
        if proc.status() == psutil.STATUS_ZOMBIE:
            if proc.ppid() == os.getpid():
                os.waitpid(ref.pid, os.WNOHANG)
            return False
        return True
    except psutil.NoSuchProcess:
        return False
