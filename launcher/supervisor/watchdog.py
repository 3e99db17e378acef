"""The hang watchdog's action, once ``launcher.job.hang`` finds the ranks stalled: before anything is
killed, dump every rank's Python stack (``py-spy dump``; ``--nonblocking`` where a stopped process
refuses the default mode), keep them in the job record (``hang/node<k>-rank<r>.txt``), and name the
suspect: a rank that is stopped (state T), in uninterruptible sleep (D) or gone, else one that is not
waiting in a collective, against the ranks that wait in one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from launcher.job.hang import HangSpec, Stall, stalled
from launcher.job.plan import Plan
from trainer.contract import HEARTBEAT_DIR_ENV, Beat, read_beats

DUMP_TIMEOUT_S = 30.0
HANG_DIR = "hang"
# torch.distributed's Python entry points a blocked rank sits in, innermost frame first.
COLLECTIVES = frozenset(
    [
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
        "send",
        "recv",
        "monitored_barrier",
    ]
)
_FRAME = re.compile(r"^\s+(?P<name>[\w<>.]+) \((?P<file>[^:()]+):\d+\)")
_SUSPECT_STATES = {
    psutil.STATUS_STOPPED: "is stopped (SIGSTOP?)",
    psutil.STATUS_TRACING_STOP: "is stopped by a tracer",
    psutil.STATUS_DISK_SLEEP: "is in uninterruptible sleep (state D: I/O, a driver)",
    psutil.STATUS_ZOMBIE: "has exited (a zombie)",
    "gone": "is gone",
}


@dataclass(frozen=True)
class RankStack:
    """One rank at the moment of the hang."""

    beat: Beat
    node: int
    host: str
    state: str  # psutil's status (running, sleeping, stopped, disk-sleep, ...) or "gone"
    stack: str  # py-spy's dump, or why there is none
    waits_in: str | None  # the collective its main thread is blocked in, if any

    @property
    def suspect(self) -> str | None:
        """Why this rank is suspect, or None when it waits in a collective like a healthy peer."""
        if self.state in _SUSPECT_STATES:
            return _SUSPECT_STATES[self.state]
        if self.waits_in is None:
            return f"is not in a collective ({self.beat.phase} phase, step {self.beat.step})"
        return None

    def describe(self) -> str:
        return f"rank {self.beat.rank} (node {self.node}, {self.host})"


def py_spy_dump(pid: int) -> str:
    """``py-spy dump`` of ``pid``: the blocking mode first (consistent stacks), then ``--nonblocking``
    (works on a stopped process). Never raises: a failure is described in the text."""
    beside = Path(sys.executable).parent / "py-spy"  # this environment's, when it is not on PATH
    exe = str(beside) if beside.is_file() else shutil.which("py-spy")
    if exe is None:
        return "no stack: py-spy is not installed on this host (pip install py-spy)"
    errors = []
    for extra in ([], ["--nonblocking"]):
        try:
            proc = subprocess.run(
                [exe, "dump", "--pid", str(pid), *extra],
                capture_output=True,
                text=True,
                timeout=DUMP_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            errors.append(f"py-spy dump {' '.join(extra)}: no answer within {DUMP_TIMEOUT_S:.0f} s")
            continue
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout
        errors.append(f"py-spy dump {' '.join(extra)}: {(proc.stderr or proc.stdout).strip()}")
    return "no stack:\n" + "\n".join(errors)


def waits_in(stack: str) -> str | None:
    """The collective the main thread's innermost torch.distributed frame is, or None. A rank blocked
    in DDP's backward waits for its gradient all_reduce, which runs in C++ under ``backward``."""
    main = stack.split('"MainThread"', 1)[-1].split("\nThread ", 1)[0]
    for line in main.splitlines():
        frame = _FRAME.match(line)
        if frame is None:
            continue
        name, file = frame["name"], frame["file"]
        if name in COLLECTIVES and "torch/distributed" in file:
            return name
        if name in ("backward", "run_backward") and "torch/" in file:
            return "backward (DDP's gradient all_reduce)"
    return None


def _state(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return "gone"


def inspect(beat: Beat, node: int, host: str) -> RankStack:
    """The rank of ``beat`` (a process on this machine): its state, then its stack."""
    state = _state(beat.pid)
    stack = py_spy_dump(beat.pid) if state != "gone" else "no stack: the process is gone"
    return RankStack(beat, node, host, state, stack, waits_in(stack))


def write_stacks(job_dir: Path, ranks: list[RankStack]) -> Path:
    """``job_dir/hang/node<k>-rank<r>.txt`` for each rank: its state and beat, then its stack."""
    out = job_dir / HANG_DIR
    out.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        b = r.beat
        header = (
            f"{r.describe()}, pid {b.pid}: state {r.state}; last advanced at step {b.step} in the {b.phase} "
            f"phase; waits in: {r.waits_in or '-'}\n\n"
        )
        (out / f"node{r.node}-rank{b.rank}.txt").write_text(header + r.stack)
    return out


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} waits"
    return f"ranks {', '.join(map(str, ranks))} wait"


def hang_message(stall: Stall, ranks: list[RankStack], stacks_dir: Path) -> str:
    """One line: how long, at which step, the suspects and what the others wait in, where the stacks
    are. E.g. ``hang: no progress for 124 s at step 1,234: rank 1 (node 1, gl-h2) is stopped
    (SIGSTOP?); ranks 0, 2, 3 wait in all_reduce; stacks in JOB/hang/``."""
    suspects = [f"{r.describe()} {r.suspect}" for r in ranks if r.suspect]
    waiting: dict[str, list[int]] = {}
    for r in ranks:
        if r.suspect is None and r.waits_in is not None:
            waiting.setdefault(r.waits_in, []).append(r.beat.rank)
    waits = [f"{_ranks(rs)} in {what}" for what, rs in waiting.items()]
    parts = [*suspects, *waits] or ["no rank stands out"]
    return (
        f"hang: no progress for {stall.silent_s:.0f} s (budget {stall.budget_s:.0f} s) at step "
        f"{stall.step:,}: " + "; ".join(parts) + f"; stacks in {stacks_dir}/"
    )


class HangWatch:
    """The watchdog of a job whose ranks all run on this machine (the local scheduler): it reads the
    heartbeat directory each node's environment names, at most every ``poll_s`` seconds."""

    def __init__(self, plan: Plan, spec: HangSpec, job_dir: Path, poll_s: float = 1.0) -> None:
        self.spec, self.job_dir, self.poll_s = spec, job_dir, poll_s
        self.nodes = [
            (n.node_rank, n.host, Path(n.env[HEARTBEAT_DIR_ENV]))
            for n in plan.nodes
            if HEARTBEAT_DIR_ENV in n.env
        ]
        self.expected = plan.nproc_per_node * len(self.nodes)
        self._next = 0.0

    def check(self) -> str | None:
        """The hang's message once the ranks are stalled (after dumping their stacks), else None."""
        if not self.nodes or time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + self.poll_s
        beats = [(k, host, b) for k, host, d in self.nodes for b in read_beats(d)]
        stall = stalled(self.spec, [b for _, _, b in beats], self.expected, time.time())
        if stall is None:
            return None
        ranks = [inspect(b, k, host) for k, host, b in beats]
        return hang_message(stall, ranks, write_stacks(self.job_dir, ranks))
