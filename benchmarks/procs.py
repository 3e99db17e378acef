"""Process and CPU-sampling helpers shared by the benchmarks: run commands with a clean environment,
kill what they leave behind on failure, and measure how much CPU *other* processes took meanwhile.

On a shared 2-core machine, a neighbour's compile job changes our timings more than anything we
measure, so every benchmark records the foreign load (``CpuSample.other_load``) next to its numbers.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 40
# How often wait_all looks at its processes: its delay in noticing an exit, tiny next to a run of seconds.
POLL_S = 0.005
# torchrun / launcher variables that must not leak into the runs from the caller's environment.
DROPPED_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "GPTLAUNCH_FAULT",
)
PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>
# psutil.cpu_times() fields that count as busy: everything but idle and iowait, hypervisor steal
# included (a stolen core is as unavailable to us as a busy one). guest/guest_nice are left out because
# the kernel already counts them in user/nice. Only some fields exist outside Linux.
BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")


class BenchError(RuntimeError):
    """A run failed or produced unusable results; the message says which and shows its output tail."""


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def available_cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return psutil.cpu_count() or 1


def cpu_model() -> str:
    """The CPU model name (psutil does not report it, hence /proc/cpuinfo), or the platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def child_env(threads: int | None = None) -> dict[str, str]:
    """The caller's environment without torchrun variables, with this checkout first on the import path
    and, when given, ``threads`` OpenMP threads per process."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (see BUSY_FIELDS)."""
    times = psutil.cpu_times()
    return sum(getattr(times, name, 0.0) for name in BUSY_FIELDS)


def children_cpu_seconds() -> float:
    """CPU seconds used by this process's terminated and waited-for descendants (the kernel adds a
    grandchild's time to its parent's once the parent waits for it, so torchrun's ranks are included)."""
    times = psutil.Process().cpu_times()
    return times.children_user + times.children_system


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds at one instant: busy on the whole machine, and used by this process's children."""

    busy_s: float
    children_s: float
    t: float  # time.perf_counter(), seconds

    @classmethod
    def now(cls) -> CpuSample:
        return cls(machine_busy_seconds(), children_cpu_seconds(), time.perf_counter())

    def other_load(self, start: CpuSample) -> float:
        """Fraction of all cores used since ``start`` by processes that are not our (waited-for)
        children, hypervisor steal included: 0 on a quiet machine. Approximate: children still running
        at this sample are counted as other processes."""
        wall = self.t - start.t
        other = (self.busy_s - start.busy_s) - (self.children_s - start.children_s)
        return max(0.0, other / (wall * available_cores())) if wall > 0 else 0.0


def start_process(
    cmd: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path | str | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session (so its whole process group can be killed), stdout+stderr to
    ``log_path``, in ``cwd`` (default: the log's directory)."""
    with open(log_path, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=log_path.parent if cwd is None else cwd,
            start_new_session=True,
        )


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group (torchrun's ranks too) and reap it."""
    with contextlib.suppress(ProcessLookupError):  # already gone with its group
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def command_line(proc: subprocess.Popen[bytes]) -> str:
    """``proc``'s command, quoted for a shell."""
    return shlex.join(str(a) for a in proc.args) if isinstance(proc.args, list) else str(proc.args)


def kill_descendants() -> int:
    """SIGKILL every live descendant of this process (there are only the benchmark's); returns how many."""
    left = psutil.Process().children(recursive=True)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return len(left)


def wait_process(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    """Wait for ``proc``; raises BenchError (with the output tail) on a non-zero exit or after
    ``timeout_s`` seconds, killing its process group then. Ctrl-C kills it too."""
    cmd = command_line(proc)
    try:
        code = proc.wait(timeout=timeout_s)
    except BaseException as e:  # timeout or Ctrl-C: do not leave ranks behind
        kill_group(proc)
        if isinstance(e, subprocess.TimeoutExpired):
            msg = f"timed out after {timeout_s:.0f} s: {cmd}\n--- output tail ---\n"
            raise BenchError(msg + tail(log_path)) from None
        raise
    if code != 0:
        raise BenchError(f"exit code {code}: {cmd}\n--- output tail ---\n{tail(log_path)}")


def run_process(
    cmd: Sequence[str], env: Mapping[str, str], log_path: Path, timeout_s: float, cwd: Path | None = None
) -> CpuSample:
    """Run ``cmd`` to completion (see start_process and wait_process); returns the CPU sample taken
    just before it started."""
    start = CpuSample.now()
    wait_process(start_process(cmd, env, log_path, cwd), log_path, timeout_s)
    return start


def wait_for_quiet(max_wait_s: float, max_load: float) -> None:
    """Wait (up to ``max_wait_s`` seconds) until processes outside the benchmark use at most
    ``max_load`` of the CPUs over one second, so a run starts in a calm moment when there is one."""
    t0 = time.perf_counter()
    while True:
        before = CpuSample.now()
        time.sleep(1.0)
        load = CpuSample.now().other_load(before)
        waited = time.perf_counter() - t0
        if load <= max_load or waited >= max_wait_s:
            break
    if waited > 1.5:
        log(f"waited {waited:.0f} s for other processes to calm down (now {load:.0%} of the CPUs)")


def wait_all(procs: Sequence[subprocess.Popen[bytes]], logs: Sequence[Path], timeout_s: float) -> None:
    """Wait until every process has exited. On the first non-zero exit, after ``timeout_s`` seconds or
    on Ctrl-C, kill them all and raise BenchError with the failed ones' output tails: one failed torchrun
    agent would otherwise leave its peer waiting for the rendezvous until its own timeout."""
    deadline = time.perf_counter() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(codes):  # a non-zero exit code (None, still running, and 0 are both falsy)
                raise BenchError(failure_report(procs, logs, codes))
            if None not in codes:
                return
            if time.perf_counter() > deadline:
                raise BenchError(f"timed out after {timeout_s:.0f} s\n{failure_report(procs, logs, codes)}")
            time.sleep(POLL_S)
    except BaseException:
        for p in procs:
            kill_group(p)
        kill_descendants()  # what left the groups (setsid), e.g. the launcher's supervisor and agents
        raise


def failure_report(
    procs: Sequence[subprocess.Popen[bytes]], logs: Sequence[Path], codes: Sequence[int | None]
) -> str:
    """Command, exit code (or "still running") and output tail of every process that did not exit 0."""
    parts = []
    for proc, log_path, code in zip(procs, logs, codes, strict=True):
        if code != 0:
            state = "still running" if code is None else f"exit code {code}"
            parts.append(f"{state}: {command_line(proc)}\n--- output tail ({log_path}) ---\n{tail(log_path)}")
    return "\n".join(parts)


def become_subreaper() -> bool:
    """Make descendants orphaned by their parent re-parent to this process instead of init (Linux
    prctl; False elsewhere). A program that forks a helper and exits without waiting for it (as the
    launcher's supervisor) would otherwise take that helper's CPU time out of children_cpu_seconds,
    and its exit would hide processes still running: reap_orphans finds both."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def reap_orphans(timeout_s: float) -> float:
    """Once every started process has been waited for: wait until no descendant is left (orphans
    re-parented here by become_subreaper) and reap them, which adds their CPU time to ours. Returns the
    seconds that took (0 when nothing was left); kills them and raises BenchError after ``timeout_s``."""
    t0 = time.perf_counter()
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no children at all: done
            return time.perf_counter() - t0
        if pid:
            continue  # reaped one; look for the next at once
        if time.perf_counter() - t0 > timeout_s:
            left = kill_descendants()
            raise BenchError(f"{left} process(es) still running {timeout_s:.0f} s later (killed)")
        time.sleep(POLL_S)
