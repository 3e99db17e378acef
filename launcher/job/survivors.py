"""The console after a failure: what the ranks and torchruns print once an attempt fails follows from
it (a peer's "connection closed" traceback, the torchruns the launcher stops, a survivor's own
messages), whatever its shape, and goes to the node logs only; the console shows the failed rank's
own lines and says the cause once (the retry's line, or the job's summary).

The controller writes that fact in the job's status (``JobStatus.failing``) as soon as it finds an
attempt failing, before it stops anything, and again once its verdict names the failed rank
(``decided``). Each node line reaches the console HOLD_S seconds after it was read, so that what was
printed between the failure and the controller knowing of it is still held then; from then on node
lines wait for the verdict (at most DECIDE_MAX_S). Nothing here reads the lines' words: only their
node and rank labels.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from launcher.job.collapse import WINDOW_S, members, merged
from launcher.job.logs import TICK
from launcher.job.record import Failing, JobStatus

# Longer than a rank's death takes to reach the console: torchrun's monitor interval (0.1 s), its word
# to the node agent (``launcher.agent.torchrun``), the supervisor's poll (0.1 s), this console's read
# of the status (STATUS_EVERY_S). ``benchmarks/bench_failing.py``, kill -> status: 0.15 s median
# (0.10-0.20), 0.22 s with three busy processes on 2 cores (0.09-0.25). Where torchrun cannot tell (a
# torchrun in a container the agent starts, a --python other than the launcher's), the status
# follows torchrun's exit: 0.5-0.7 s there, still within the hold.
HOLD_S = 1.5
assert HOLD_S >= WINDOW_S  # a collapsed line's wait is within its hold
# The longest a verdict may take to name the rank: the other nodes' hang reports (30 s), the kill's
# grace and the channels' drain (5 s each). Past it, every node line since the failure is left out.
DECIDE_MAX_S = 60.0
STATUS_EVERY_S = 0.25  # how often the status is read for the fact
_LABEL = re.compile(r"^(?:\S+ )?node(\d+) \| (?:\[rank(\d+)\]: )?")  # ``NodePlan.label``, a rank's prefix


def node_of(line: str) -> tuple[int, int | None] | None:
    """(node rank, the rank that printed it, None for its torchrun's own) of a node-labelled console
    line; None for another line (the launcher's)."""
    match = _LABEL.match(line)
    if match is None:
        return None
    return int(match[1]), int(match[2]) if match[2] is not None else None


def left_to_logs(
    lines: Iterable[str],
    status: Callable[[], JobStatus],
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[str]:
    """``lines`` (TICK passes at once), each held until HOLD_S seconds (by ``clock``) after it came,
    less the node lines that followed from a failure: those that came from HOLD_S before ``status()``
    (read every STATUS_EVERY_S) named the attempt failing until the next attempt started, but the
    failed rank's own once the verdict named it. A ``launcher.job.collapse.Collapsed`` line counts
    from when each line it stands for came, and is shown as the lines of it that are left."""
    held: deque[tuple[float, str]] = deque()  # (when its last member came, line)
    windows: list[_Window] = []  # the failures seen, newest last
    next_read = -math.inf
    for line in itertools.chain(lines, [None]):
        now = clock()
        if line is None or now >= next_read:
            next_read = now + STATUS_EVERY_S
            _note(windows, status(), now)
        if line:
            held.append((max(at for at, _ in members(line, now)), line))
        due = now - HOLD_S if line is not None else math.inf
        while held and held[0][0] <= due:
            timed = [(_window_of(windows, at), text) for at, text in members(held[0][1], held[0][0])]
            if line is not None and any(w is not None and not w.decided(now) for w, _ in timed):
                break  # the verdict may still name the rank whose lines these are
            held.popleft()
            shown = [text for window, text in timed if window is None or window.shows(node_of(text))]
            if shown:
                yield merged(shown)
        if line == TICK:
            yield TICK


def _window_of(windows: list[_Window], at: float) -> _Window | None:
    """The failure whose aftermath a line that came at ``at`` is, if any."""
    return next((w for w in windows if w.start <= at < w.end), None)


@dataclass
class _Window:
    """A failure as this console saw it: node lines read from ``start`` until ``end`` (the fact
    cleared) follow from it, but the failed rank's once ``fact`` names it."""

    fact: Failing
    start: float
    seen: float
    end: float = math.inf

    def decided(self, now: float) -> bool:
        return self.fact.decided or now - self.seen > DECIDE_MAX_S

    def shows(self, label: tuple[int, int | None] | None) -> bool:
        if label is None:  # not a node's line
            return True
        node, rank = label
        named = self.fact.decided and self.fact.node == node and rank is not None
        return named and self.fact.rank in (None, rank)


def _note(windows: list[_Window], status: JobStatus, now: float) -> None:
    """Open a window for a failing attempt, update it with the verdict; close it when the next attempt
    starts (the verdict then read from the archived attempt, if it was missed); drop it when the
    failure turned out to be none (a stop)."""
    current = windows[-1] if windows and windows[-1].end == math.inf else None
    fact = status.failing
    if current is not None:
        if status.attempt > current.fact.attempt:
            current.end, current.fact = now, _named(current.fact, status)
        elif fact is None:
            windows.remove(current)
        elif fact.attempt == current.fact.attempt:
            current.fact = fact
    if fact is not None and not any(w.fact.attempt == fact.attempt for w in windows):
        window = _Window(fact, now - HOLD_S, now)
        if status.attempt > fact.attempt:  # the next attempt started before this read: one read late
            window.end, window.fact = now, _named(fact, status)
        windows.append(window)


def _named(fact: Failing, status: JobStatus) -> Failing:
    """``fact`` decided: as the controller said, or from the root cause its attempt was archived with."""
    said = status.failing
    if said is not None and said.attempt == fact.attempt and said.decided:
        return said
    if fact.decided or len(status.attempts) < fact.attempt:
        return fact
    failure = status.attempts[fact.attempt - 1].failure
    named = {"node": failure.node_rank, "rank": failure.rank} if failure is not None else {}
    return fact.model_copy(update={"decided": True, **named})
