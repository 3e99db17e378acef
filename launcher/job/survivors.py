"""The console after a failure: what the other nodes print once an attempt fails follows from it (a
peer's "connection closed" traceback, the torchruns the launcher stops, a survivor's own messages),
whatever its shape, and goes to the node logs only; the console says the cause once (the retry's
line, or the job's summary).

The controller writes that fact in the job's status (``JobStatus.failing``) as soon as it finds an
attempt failing, before it stops the other nodes. Each node line reaches the console HOLD_S seconds
after it was read, so that what a survivor printed between the failure and the controller knowing
of it is still held then and is left out too. The failed node's own lines (its rank's error) are
shown; after a hang (no failed node) no node's are. Nothing here reads the lines' words.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from launcher.job.logs import TICK
from launcher.job.record import Failing

# Longer than a rank's death takes to reach the status: torchrun's monitor interval (0.1 s), its exit
# (about 1 s, more on a loaded machine), the supervisor's poll (0.1 s).
HOLD_S = 3.0
STATUS_EVERY_S = 0.25  # how often the status is read for the fact
_NODE = re.compile(r"^(?:\S+ )?node(\d+) \| ")  # ``NodePlan.label``: ``node1`` or ``gpu-b node1``


def node_of(line: str) -> int | None:
    """The node rank of a node-labelled console line (None for another line)."""
    match = _NODE.match(line)
    return int(match[1]) if match else None


def left_to_logs(
    lines: Iterable[str],
    failing: Callable[[], Failing | None],
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[str]:
    """``lines`` (TICK passes at once), each held HOLD_S seconds (by ``clock``), less the lines that
    followed from a failure: once ``failing()`` (the status's fact, read every STATUS_EVERY_S) names
    the attempt failing, those of every other node read from HOLD_S before it was seen until the fact
    is cleared (the next attempt)."""
    held: deque[tuple[float, str]] = deque()
    windows: list[_Window] = []  # the failures seen, newest last
    next_read = -math.inf
    for line in itertools.chain(lines, [None]):
        now = clock()
        if line is None or now >= next_read:
            next_read = now + STATUS_EVERY_S
            _note(windows, failing(), now)
        if line:
            held.append((now, line))
        due = now - HOLD_S if line is not None else math.inf
        while held and held[0][0] <= due:
            read_at, text = held.popleft()
            node = node_of(text)
            if not any(w.covers(read_at, node) for w in windows):
                yield text
        if line == TICK:
            yield TICK


@dataclass
class _Window:
    """A failure as this console saw it: lines of nodes other than ``fact.node`` read from ``start``
    until ``end`` (the fact cleared) follow from it."""

    fact: Failing
    start: float
    end: float = math.inf

    def covers(self, read_at: float, node: int | None) -> bool:
        if node is None or not self.start <= read_at < self.end:
            return False
        return self.fact.node is None or node != self.fact.node


def _note(windows: list[_Window], fact: Failing | None, now: float) -> None:
    """Open a window for a new fact, close the open one when the fact changed or went."""
    current = windows[-1] if windows and windows[-1].end == math.inf else None
    if current is not None and current.fact == fact:
        return
    if current is not None:
        current.end = now
    if fact is not None:
        windows.append(_Window(fact, now - HOLD_S))
