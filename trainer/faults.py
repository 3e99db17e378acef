"""Failure drills: a fault injected at a step of one rank, to see a job fail and recover for real."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from gptlaunch import runtime
from trainer.distributed import DistEnv
from trainer.errors import ConfigError

FAULT_ENV = "GPTLAUNCH_FAULT"  # "RANK:STEP[:SIGNAL]"


@dataclass(frozen=True)
class FaultInjection:
    """Failure drills: ``GPTLAUNCH_FAULT=RANK:STEP`` makes that rank raise at that step, in every
    attempt (a program fault); ``RANK:STEP:SIGNAL`` (``SIGKILL``) sends that rank's process the
    signal there, in the job's first attempt only (a fault from outside, which a retry does not meet
    again): at the top of the step, where the other ranks wait for it in the step's first collective."""

    rank: int
    at_step: int | None  # None: no fault for this rank
    sent: signal.Signals | None = None  # the signal, or None: raise

    @classmethod
    def from_env(cls, env: DistEnv) -> FaultInjection:
        """This rank's drill from the environment. Raises ConfigError for a malformed value."""
        spec = os.environ.get(FAULT_ENV, "")
        if not spec:
            return cls(env.rank, None)
        parts = spec.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError(spec)
            rank, step = int(parts[0]), int(parts[1])
            sent = signal.Signals[parts[2]] if len(parts) == 3 else None
        except (KeyError, ValueError):
            raise ConfigError(
                f"{FAULT_ENV}={spec!r}: use RANK:STEP or RANK:STEP:SIGNAL, e.g. 1:3:SIGKILL"
            ) from None
        mine = rank == env.rank and not (sent is not None and runtime.retried())
        return cls(env.rank, step if mine else None, sent)

    def check(self, step: int) -> None:
        if step != self.at_step:
            return
        if self.sent is None:
            raise RuntimeError(f"injected fault on rank {self.rank} at step {step} ({FAULT_ENV})")
        runtime.flush()  # the step reached, as the launcher would have it from a later beat
        os.kill(os.getpid(), self.sent)
