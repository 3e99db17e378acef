"""When a job is hung: the watchdog's budgets and its verdict on the ranks' heartbeats (pure).

Each rank publishes a ``trainer.contract.Beat``: its step, its phase (start-up, steps, evaluation,
checkpoint) and when it last advanced. A node is hung when none of its ranks has advanced within the
budget of the phase it is in: ``timeout_s`` for steps (default max(120 s, 10 × the slowest recent
step), armed after the first completed step), and larger, separate budgets for start-up (data
preparation, rendezvous, compilation), evaluation and checkpointing. ``timeout_s`` 0 turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from trainer.contract import Beat

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


@dataclass(frozen=True)
class Stall:
    """Ranks that have not advanced within their budgets: the oldest beat among them, and its age."""

    beats: list[Beat]
    silent_s: float  # seconds since the most recent beat of any of them
    budget_s: float

    @property
    def step(self) -> int:
        return max(b.step for b in self.beats)


def stalled(spec: HangSpec, beats: list[Beat], expected: int, now: float) -> Stall | None:
    """The stall of one node (or job) whose ``expected`` ranks published ``beats`` (epoch-second
    ``now``): every rank has beaten and none has advanced within its phase's budget. None while any
    rank advances, a rank has yet to beat (it is still starting), or the watchdog is off."""
    if not spec.enabled or not beats or len(beats) < expected:
        return None
    budgets = [spec.budget(b) for b in beats]
    if any(now - b.time < budget for b, budget in zip(beats, budgets, strict=True)):
        return None
    return Stall(beats=beats, silent_s=now - max(b.time for b in beats), budget_s=max(budgets))
