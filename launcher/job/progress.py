"""Where a running job's nodes are, from their ranks' heartbeats (``gptlaunch.contract.Beat``): for
``launcher status``. Each scheduler finds the beats (``Scheduler.heartbeats``): in the job record
(``recorded_beats``: local, SLURM, compose) or on the hosts (SSH).

Stragglers are judged here (``stragglers``), for every program alike: each rank's beat carries its
mean forward seconds per recent step, timed with no change to the program by ``gptlaunch.compute``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from gptlaunch.contract import Beat, read_beats
from gptlaunch.stats import ratios_to_others
from launcher.job.hang import HangSpec, heartbeat_dir, stalled
from launcher.job.plan import Plan

# A rank this much slower than the median of the others is a straggler. Each measure is already a mean
# over the rank's last 10 s of steps (``gptlaunch.compute.WINDOW_S``), so one slow step names nobody.
STRAGGLER_RATIO = 1.25


class NodeProgress(BaseModel):
    """One node's ranks as of their last beats. Ages in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    node_rank: int
    host: str | None
    ranks: int  # ranks that have published a beat
    step: int  # the furthest rank's step
    phase: str  # the phase of the rank that beat last
    heartbeat_age_s: float  # since the node's most recent beat
    stalled_s: float | None  # seconds without progress past the hang budget, else None
    stragglers: dict[int, float]  # rank -> its compute time over the median of the other ranks
    warnings: dict[int, str] = {}  # rank -> what its program warns of now (``runtime.warn``)

    def describe(self) -> str:
        where = f"node {self.node_rank}" + (f" ({self.host})" if self.host else "")
        text = f"{where}: step {self.step:,} ({self.phase}), heartbeat {self.heartbeat_age_s:.0f} s ago"
        if self.stalled_s is not None:
            text += f", NO PROGRESS for {self.stalled_s:.0f} s (over the hang budget)"
        for rank, ratio in sorted(self.stragglers.items()):
            text += f", straggler: rank {rank} at {ratio:.1f}× the others' compute time (forward passes)"
        for rank, warning in sorted(self.warnings.items()):
            text += f"\n    rank {rank} warns: {warning}"
        return text


def recorded_beats(plan: Plan, job_dir: Path) -> dict[int, list[Beat]]:
    """Each node's beats in the job record (``heartbeat_dir``), by node_rank."""
    return {n.node_rank: read_beats(heartbeat_dir(job_dir, n.node_rank)) for n in plan.nodes}


def last_step(beats_of: dict[int, list[Beat]]) -> int | None:
    """The furthest step any rank in ``beats_of`` (by node_rank) reached; None when none beat."""
    return max((b.step for beats in beats_of.values() for b in beats), default=None)


def node_progress(
    plan: Plan, hang: HangSpec, beats_of: dict[int, list[Beat]], now: float
) -> list[NodeProgress]:
    """The progress of each node of ``plan`` with beats in ``beats_of`` (by node_rank). ``now``:
    epoch seconds."""
    slow = stragglers(b for beats in beats_of.values() for b in beats)
    found = []
    for node in plan.nodes:
        beats = beats_of.get(node.node_rank, [])
        if not beats:
            continue
        last = max(beats, key=lambda b: b.time)
        stall = stalled(hang, beats, plan.nproc_per_node, now)
        found.append(
            NodeProgress(
                node_rank=node.node_rank,
                host=node.named_host,
                ranks=len(beats),
                step=max(b.step for b in beats),
                phase=last.phase,
                heartbeat_age_s=max(0.0, now - last.time),
                stalled_s=stall.silent_s if stall else None,
                stragglers={b.rank: slow[b.rank] for b in beats if b.rank in slow},
                warnings={b.rank: b.warning for b in beats if b.warning},
            )
        )
    return found


def stragglers(beats: Iterable[Beat]) -> dict[int, float]:
    """The ranks whose compute per step (``Beat.compute_s``) is over STRAGGLER_RATIO × the median of the
    other ranks', by rank, with that ratio; ranks not yet timed are left out (none with fewer than two)."""
    timed = {b.rank: b.compute_s for b in beats if b.compute_s}
    ratios = zip(timed, ratios_to_others(list(timed.values())), strict=True)
    return {rank: ratio for rank, ratio in ratios if ratio > STRAGGLER_RATIO}
