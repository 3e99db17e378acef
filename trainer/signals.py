"""Stop requests from signals (SIGTERM from a scheduler, SIGUSR2 as SLURM's pre-timeout warning).

The handler only records the request; the loop acts on it at the next step boundary, agreed on by all
ranks, so the checkpoint is consistent and no rank waits in a collective for a peer that left.
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType
from typing import Any


class StopRequest:
    """Context manager installing handlers for ``names`` (e.g. ("SIGTERM", "SIGUSR2")); restores the
    previous handlers on exit. ``requested`` becomes True once any of them arrives."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.signals = [signal.Signals[name] for name in names]
        self.requested = False
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        self.received = signal.Signals(signum)

    def __enter__(self) -> StopRequest:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
