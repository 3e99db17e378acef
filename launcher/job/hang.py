"""When a job is hung: the watchdog's budgets, its verdict on the ranks' heartbeats, and the report a
node's watchdog gives (pure: the processes are inspected in ``launcher.supervisor.watchdog``).

Each rank publishes a ``gptlaunch.contract.Beat``: its step, its phase and when it last advanced. A node
is hung when none of its ranks has advanced within the budget of the phase it is in (``HangSpec``).

A watchdog that is not the launcher's own process (the SSH host agent, SLURM's node task, a compose
container's entry) sends its ``HangReport`` as a report (``launcher.job.reports.Hang``) and exits
``EXIT_HANG``; the launcher merges every node's report (``merge``), keeps each rank's stack in the job
record (``write_stacks``) and names the suspect (``hang_message``): a rank stopped, in uninterruptible
sleep or outside any collective, or one whose flight recorder shows it short of a collective the others
reached (``Collective``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from gptlaunch.contract import Beat

FLOOR_S = 120.0  # the automatic step budget is never below this
STEP_FACTOR = 10.0  # ... nor below this many times the slowest recent step


class HangSpec(BaseModel):
    """The hang watchdog's budgets, seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    timeout_s: float | None = Field(
        None,
        ge=0,
        description="no progress for this long during steps is a hang: stacks are dumped and the job "
        "ends (default: max(120, 10 × the slowest recent step); 0: off)",
    )
    startup_s: float = Field(
        1800.0, gt=0, description="budget of start-up: data preparation, rendezvous, compilation, first step"
    )
    phase_s: float = Field(900.0, gt=0, description="budget of one evaluation or checkpoint")

    @property
    def enabled(self) -> bool:
        return self.timeout_s != 0

    def budget(self, beat: Beat) -> float:
        """Seconds ``beat``'s rank may go without advancing in its phase."""
        if beat.phase == "startup":
            return self.startup_s
        if beat.phase in ("eval", "checkpoint"):
            return self.phase_s
        if self.timeout_s is not None:
            return self.timeout_s
        return max(FLOOR_S, STEP_FACTOR * beat.slowest_step_s)


def heartbeat_dir(job_dir: Path, node: int) -> Path:
    """Where node ``node``'s ranks beat when the node sees the job record (local, SLURM, compose):
    ``launcher status`` reads them there. (An SSH host keeps its own, in the host agent's state.)"""
    return job_dir / "heartbeat" / f"node-{node}"


def watch_args(spec: HangSpec, nproc_per_node: int) -> list[str]:
    """The flags that hand ``spec`` to a node-side watchdog (``add_watch_flags``); none when it is off."""
    if not spec.enabled:
        return []
    timeout = ["--hang-timeout-s", f"{spec.timeout_s:g}"] if spec.timeout_s is not None else []
    return [
        *("--nproc-per-node", str(nproc_per_node), *timeout),
        *("--hang-startup-s", f"{spec.startup_s:g}", "--hang-phase-s", f"{spec.phase_s:g}"),
    ]


def add_watch_flags(parser: argparse.ArgumentParser) -> None:
    """The node side of ``watch_args``."""
    parser.add_argument("--nproc-per-node", type=int, help="watch this many ranks for hangs")
    parser.add_argument("--hang-timeout-s", type=float, help="see `launcher submit --help`")
    parser.add_argument("--hang-startup-s", type=float, default=HangSpec().startup_s)
    parser.add_argument("--hang-phase-s", type=float, default=HangSpec().phase_s)


def parse_with_command(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, list[str]]:
    """A node-side entry's ``FLAGS -- COMMAND...`` (``sys.argv[1:]`` when ``argv`` is None): its parsed
    flags and the command after ``--`` (empty when there is none)."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def watch_of(args: argparse.Namespace) -> tuple[HangSpec, int] | None:
    """(budgets, ranks to watch) from ``add_watch_flags``' arguments, or None: no watchdog."""
    if not args.nproc_per_node:
        return None
    spec = HangSpec(timeout_s=args.hang_timeout_s, startup_s=args.hang_startup_s, phase_s=args.hang_phase_s)
    return (spec, args.nproc_per_node) if spec.enabled else None


@dataclass(frozen=True)
class Stall:
    """Ranks that have not advanced within their budgets."""

    step: int  # the furthest step of any of them
    silent_s: float  # seconds since the most recent beat of any of them
    budget_s: float


def stalled(spec: HangSpec, beats: list[Beat], expected: int, now: float) -> Stall | None:
    """The stall of one node (or job) whose ``expected`` ranks published ``beats`` (epoch-second
    ``now``): every rank has beaten and none has advanced within its phase's budget. None while any
    rank advances, a rank has yet to beat (it is still starting), or the watchdog is off."""
    if not spec.enabled or not beats or len(beats) < expected:
        return None
    budgets = [spec.budget(b) for b in beats]
    if any(now - b.time < budget for b, budget in zip(beats, budgets, strict=True)):
        return None
    return Stall(
        step=max(b.step for b in beats), silent_s=now - max(b.time for b in beats), budget_s=max(budgets)
    )


# After one node reports a hang, how long the others get to report theirs (the launcher waits that
# long; a node-side watchdog holds its ranks longer: ``launcher.supervisor.watchdog.HOLD_S``).
HANG_REPORTS_S = 30.0
EXIT_HANG = 124  # a node's watchdog ended its ranks after reporting a hang (as `timeout` does)
HANG_DIR = "hang"
_SUSPECT_STATES = {
    "stopped": "is stopped (SIGSTOP?)",
    "tracing-stop": "is stopped by a tracer",
    "disk-sleep": "is in uninterruptible sleep (state D: I/O, a driver)",
    "zombie": "has exited (a zombie)",
    "gone": "is gone",
}


class Collective(BaseModel):
    """The last collective a rank's flight recorder holds (``launcher.supervisor.watchdog``)."""

    model_config = ConfigDict(frozen=True)
    pg: int  # the process group's id (0: the default group)
    seq: int  # its sequence number within that group: the same on every rank for the same call
    op: str  # e.g. gloo:all_reduce, nccl:all_reduce
    done: bool

    def describe(self) -> str:
        return f"{self.op} #{self.seq}" + ("" if self.pg == 0 else f" of process group {self.pg}")


class RankReport(BaseModel):
    """One rank at the moment of the hang."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    rank: int
    local_rank: int
    pid: int
    node: int
    host: str
    step: int
    phase: str
    state: str  # psutil's status (running, sleeping, stopped, disk-sleep, ...) or "gone"
    waits_in: str | None  # the collective its main thread is blocked in, if any
    python_frames: int = 0  # of its main thread in the stack (0: caught in C/C++, nothing to read)
    collective: Collective | None = None  # from its flight recorder, when it answered
    stack: str  # py-spy's dump (and the flight recorder's last collectives), or why there is none

    @property
    def suspect(self) -> str | None:
        """Why this rank is suspect, or None when it waits in a collective like a healthy peer."""
        if self.state in _SUSPECT_STATES:
            return _SUSPECT_STATES[self.state]
        if self.waits_in is None and self.python_frames:
            return f"is not in a collective ({self.phase} phase, step {self.step})"
        return None  # waits in a collective, or its stack tells nothing either way

    def describe(self) -> str:
        return f"rank {self.rank} (node {self.node}, {self.host})"


class HangReport(BaseModel):
    """What a watchdog found: how long its ranks had been silent, against which budget, and each one."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    silent_s: float
    budget_s: float
    step: int
    ranks: list[RankReport]
    time: float = 0.0  # when it was found, epoch seconds

    def summary(self) -> str:
        """One line for a node log (the report itself travels as data)."""
        ranks = ", ".join(str(r.rank) for r in self.ranks)
        return (
            f"watchdog: no progress for {self.silent_s:.0f} s (budget {self.budget_s:.0f} s) at step "
            f"{self.step:,}: took the stacks of rank(s) {ranks} and reported the hang"
        )


def merge(reports: list[HangReport], hosts: dict[int, str] | None = None) -> HangReport:
    """One report of the job from its nodes' reports; ``hosts`` (node -> the job's name for its host)
    replaces the names the nodes gave themselves. Raises ValueError for none."""
    if not reports:
        raise ValueError("no hang report to merge")
    ranks = sorted((rank for r in reports for rank in r.ranks), key=lambda rank: rank.rank)
    if hosts:
        ranks = [r.model_copy(update={"host": hosts.get(r.node, r.host)}) for r in ranks]
    return HangReport(
        silent_s=max(r.silent_s for r in reports),
        budget_s=max(r.budget_s for r in reports),
        step=max(r.step for r in reports),
        ranks=ranks,
        time=min(r.time for r in reports),
    )


def write_stacks(job_dir: Path, report: HangReport) -> Path:
    """``job_dir/hang/node<k>-rank<r>.txt`` for each rank: its state and beat, then its stack."""
    out = job_dir / HANG_DIR
    out.mkdir(parents=True, exist_ok=True)
    for r in report.ranks:
        header = (
            f"{r.describe()}, pid {r.pid}: state {r.state}; last advanced at step {r.step} in the {r.phase} "
            f"phase; waits in: {r.waits_in or '-'}\n\n"
        )
        (out / f"node{r.node}-rank{r.rank}.txt").write_text(header + r.stack)
    return out


def behind(ranks: list[RankReport]) -> dict[int, str]:
    """Ranks whose flight recorder holds an earlier collective of a process group than another
    rank's (a collective the others entered and this one never called), with why; by rank."""
    found = {}
    for r in ranks:
        if r.collective is None:
            continue
        mine = r.collective
        ahead = [
            o.collective
            for o in ranks
            if o.collective is not None and o.collective.pg == mine.pg and o.collective.seq > mine.seq
        ]
        if ahead:
            top = max(ahead, key=lambda c: c.seq)
            found[r.rank] = f"is behind: its last collective is #{mine.seq}, others are in {top.describe()}"
    return found


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, or ``ranks 0, 2, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def suspects(report: HangReport) -> dict[int, str]:
    """The ranks that stand out in a hang (stopped, not in a collective, behind the others), with
    why; by rank."""
    late = behind(report.ranks)
    why = {r.rank: r.suspect or late.get(r.rank) for r in report.ranks}
    return {rank: reason for rank, reason in why.items() if reason}


def hang_message(report: HangReport, stacks_dir: Path) -> str:
    """One line: how long, at which step, the suspects and what the others wait in, where the stacks
    are. E.g. ``hang: no progress for 124 s (budget 120 s) at step 1,234: rank 1 (node 1, gl-h2) is
    stopped (SIGSTOP?); ranks 0, 2, 3 wait in all_reduce; stacks in JOB/hang/``."""
    why = suspects(report)
    named = [f"{r.describe()} {why[r.rank]}" for r in report.ranks if r.rank in why]
    waiting: dict[str | None, list[int]] = {}  # None: no frame readable
    for r in report.ranks:
        if r.rank not in why:
            waiting.setdefault(r.waits_in, []).append(r.rank)
    unread = waiting.pop(None, [])
    parts = [*named, *(f"{_ranks(rs)} wait{'s' * (len(rs) == 1)} in {what}" for what, rs in waiting.items())]
    if unread:
        parts.append(f"no frame readable for {_ranks(unread)}")
    return (
        f"hang: no progress for {report.silent_s:.0f} s (budget {report.budget_s:.0f} s) at step "
        f"{report.step:,}: " + "; ".join(parts or ["no rank stands out"]) + f"; stacks in {stacks_dir}/"
    )
