"""Stragglers: ranks whose own compute is slower than the others', which sets the pace of all.

Each rank times its forward passes (``ComputeClock``): DDP's forward holds no collective here (the
model has no buffers to broadcast), so this is the rank's own compute, not time spent waiting for a
slow peer, which every rank's whole step includes. At each log interval the ranks share their mean
per step in the step's own all-reduce (``trainer.step.agree``: one slot per rank; no collective of
its own).
A rank slower than ``THRESHOLD`` × the median of the other ranks for ``INTERVALS`` intervals in a
row is a straggler (``Stragglers``); every rank computes the same verdict from the same numbers.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gptlaunch.stats import ratios_to_others
from trainer import distributed

THRESHOLD = 1.25
INTERVALS = 3


class ComputeClock:
    """This rank's forward seconds since the last ``take``; on CUDA through events (no sync per step)."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.cuda, self.enabled = device.type == "cuda", enabled
        self._seconds, self._steps = 0.0, 0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        if not self.enabled:  # nothing recorded: CUDA events would pile up with nobody to take them
            yield
        elif self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0

    def step_done(self) -> None:
        self._steps += 1

    def take(self) -> float:
        """Mean forward seconds per step since the last call (0 when no step ran); starts anew."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3  # ms -> s
        mean = self._seconds / self._steps if self._steps else 0.0
        self._seconds, self._steps, self._events = 0.0, 0, []
        return mean


@dataclass(frozen=True)
class Straggler:
    rank: int
    ratio: float  # its compute time per step over the median rank's


class Stragglers:
    """The ranks slower than THRESHOLD × the median for INTERVALS log intervals in a row."""

    def __init__(self, world_size: int) -> None:
        self._streak = [0] * world_size

    def update(self, seconds: list[float]) -> list[Straggler]:
        """Feed one interval's per-rank compute seconds; return the stragglers now named."""
        ratios = ratios_to_others(seconds)  # against the median of the *other* ranks (0.0: no verdict)
        self._streak = [n + 1 if r > THRESHOLD else 0 for n, r in zip(self._streak, ratios, strict=True)]
        return [Straggler(k, ratios[k]) for k, n in enumerate(self._streak) if n >= INTERVALS]


class StragglerWatch:
    """The straggler check of one rank: its clock, the shared verdict, and where each rank runs."""

    def __init__(self, device: torch.device, world_size: int, enabled: bool = True) -> None:
        self.clock = ComputeClock(device, enabled)
        self.world_size = world_size
        self._verdict = Stragglers(world_size)
        self._places: list[tuple[int, str]] | None = None
        self.last: list[float] = []  # every rank's forward seconds per step in the last interval

    def seconds_due(self, logs: bool) -> float | None:
        """This rank's mean forward seconds per step for ``agree`` to share when the step ``logs`` (a
        log interval) and the check is on; None otherwise."""
        return self.clock.take() if logs and self.clock.enabled else None

    def interval(self, shared: list[float] | None) -> list[dict[str, object]]:
        """At a log interval, every rank's ``shared`` compute seconds (``agree``'s, None when none
        were shared): the stragglers as records ``{"rank", "node", "host", "ratio"}`` (empty when
        there are none). Collective only the first time there is one to name (where ranks run)."""
        if shared is None:
            return []
        self.last = shared
        found = self._verdict.update(self.last)
        if not found:
            return []
        if self._places is None:  # once, and only once there is someone to name: same on every rank
            self._places = distributed.all_gather_object(
                (int(os.environ.get("GROUP_RANK", "0")), socket.gethostname())
            )
        return [
            {
                "rank": s.rank,
                "node": self._places[s.rank][0],
                "host": self._places[s.rank][1],
                "ratio": s.ratio,
            }
            for s in found
        ]

    def rank_tokens_per_s(self, tokens_per_step: int) -> list[float]:
        """Each rank's own throughput in the last interval, in rank order: its share of a step's
        tokens (``tokens_per_step`` over all ranks) over its forward seconds per step (0.0: none timed)."""
        mine = tokens_per_step / self.world_size
        return [round(mine / s, 1) if s > 0 else 0.0 for s in self.last]


def describe(straggler: dict[str, object]) -> str:
    """``straggler: rank 1 on node 1 (gl-h2) at 1.9× the median step time``."""
    return (
        f"straggler: rank {straggler['rank']} on node {straggler['node']} ({straggler['host']}) at "
        f"{straggler['ratio']:.1f}× the median step time (its own compute, forward passes)"
    )
