"""This rank's progress for the launcher's hang watchdog: a ``gptlaunch.contract.Beat`` in the node's
heartbeat directory (``GPTLAUNCH_HEARTBEAT_DIR``), replaced when the phase changes and at most every
``BEAT_INTERVAL_S`` while steps complete. Without that variable (bare torchrun) it does nothing.

Cost: a check of the clock per step, and a file write at most twice a second: no collective, no
fsync. Watched, the rank's flight recorder is on and served too (``gptlaunch.flight_recorder``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from gptlaunch import flight_recorder
from gptlaunch.contract import BEAT_INTERVAL_S, HEARTBEAT_DIR_ENV, Beat, write_beat
from gptlaunch.files import no_space

RECENT_STEPS = 20  # the window of "the slowest recent step"


class Place(Protocol):
    """This process's place in the job (e.g. ``trainer.distributed.DistEnv``)."""

    @property
    def rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...


class Heartbeat:
    def __init__(
        self, env: Place, directory: Path | None, compute: Callable[[], float | None] | None = None
    ) -> None:
        """``compute``: this rank's forward seconds per recent step, asked at each publish
        (``gptlaunch.compute.ForwardClock.mean_s``)."""
        self.env, self.directory, self._compute = env, directory, compute
        self.step, self.phase, self.phase_since = 0, "startup", time.time()
        self.start_step = 0
        self.tokens: int | None = None
        self.warning: str | None = None  # shown by ``launcher status`` until replaced
        self._phase_s: dict[str, float] = {}  # seconds in each phase left so far
        self._parts_s: dict[str, float] = {}  # seconds in each start-up part left so far
        self._part: str | None = None  # the start-up part now (``starting``), since ``_part_since``
        self._part_since = 0.0
        self._expect_s: float | None = None
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._written = 0.0
        self._failing = False  # the last write failed (said once, until one is written again)
        self._socket: str | None = None
        if directory is not None:
            with contextlib.suppress(OSError):
                directory.mkdir(parents=True, exist_ok=True)
            self._socket = flight_recorder.start(directory, env.rank)
        self._publish()

    @classmethod
    def from_env(cls, env: Place, compute: Callable[[], float | None] | None = None) -> Heartbeat:
        directory = os.environ.get(HEARTBEAT_DIR_ENV)
        return cls(env, Path(directory) if directory else None, compute)

    def flush(self) -> None:
        """Publish now, whatever the throttle (e.g. the step a failing rank reached)."""
        self._publish()

    def resumed(self, step: int) -> None:
        """The run starts at ``step`` (a checkpoint's, or 0)."""
        self.step = self.start_step = step

    def step_done(self, done: int, step_s: float, tokens: int | None = None) -> None:
        """Optimizer step ``done`` finished ``step_s`` seconds after the last; ``tokens``: this rank's
        tokens so far, when known."""
        self.step = done
        self.tokens = tokens if tokens is not None else self.tokens
        self._recent.append(step_s)
        if self.phase != "step":
            self._enter("step")
        elif time.time() - self._written >= BEAT_INTERVAL_S:
            self._publish()

    def enter(self, phase: str) -> str:
        """Now in ``phase`` (eval, checkpoint: each has its own budget); returns the phase left."""
        before = self.phase
        self._enter(phase)
        return before

    def starting(self, part: str, expect_s: float | None = None) -> None:
        """Now in start-up part ``part`` (expected to take ``expect_s`` seconds, where known), until the
        next part or the first step. Ignored once the start-up ended."""
        if self.phase != "startup":
            return
        now = time.time()
        self._end_part(now)
        self._part, self._part_since, self._expect_s = part, now, expect_s
        self._publish()

    def _end_part(self, now: float) -> None:
        if self._part is not None:
            self._parts_s[self._part] = self._parts_s.get(self._part, 0.0) + now - self._part_since
        self._part, self._expect_s = None, None

    def _enter(self, phase: str) -> None:
        now = time.time()
        self._phase_s[self.phase] = self._phase_s.get(self.phase, 0.0) + now - self.phase_since
        if self.phase == "startup":
            self._end_part(now)
        self.phase, self.phase_since = phase, now
        self._publish()

    def _part_now(self, now: float) -> dict[str, float]:
        """The current start-up part's seconds to ``now`` (empty outside one)."""
        if self._part is None:
            return {}
        return {self._part: self._parts_s.get(self._part, 0.0) + now - self._part_since}

    def _publish(self) -> None:
        if self.directory is None:
            return
        now = time.time()
        beat = Beat(
            rank=self.env.rank,
            local_rank=self.env.local_rank,
            pid=os.getpid(),
            step=self.step,
            phase=self.phase,
            phase_since=self.phase_since,
            time=now,
            slowest_step_s=max(self._recent, default=0.0),
            compute_s=self._compute() if self._compute else None,
            debug_socket=self._socket,
            start_step=self.start_step,
            tokens=self.tokens,
            warning=self.warning,
            phase_s=self._phase_s | {self.phase: self._phase_s.get(self.phase, 0.0) + now - self.phase_since},
            startup_s=self._parts_s | self._part_now(now),
            expect_s=self._expect_s,
        )
        self._written = now
        try:
            write_beat(self.directory, beat)
        except OSError as e:  # a full or gone disk must not stop training
            if not self._failing:
                print(f"warning: heartbeat not written to {self.directory}: {e}", file=sys.stderr, flush=True)
            if no_space(e) is None:
                self.directory = None  # gone: the watchdog goes blind
            self._failing = True  # a full disk frees up (a save that did not fit is removed): beats go on
            return
        self._failing = False
