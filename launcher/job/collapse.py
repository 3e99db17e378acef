"""The console's view of lines that several ranks print alike: one line naming the ranks.

At scale every rank prints the same warning, and 64 copies bury the one line that differs. A followed
line ``LABEL | [rankR]: TEXT`` waits up to WINDOW_S for the same TEXT from other ranks; then it is
shown once, as ``LABEL | [ranks 0-7]: TEXT`` (``N nodes | ...`` when the ranks are on several nodes).
A line that differs is never merged, so the first differing line is always shown; order is kept,
every line is shown at most WINDOW_S late, and the node logs keep every line as it was.
(torchrun's maintainers proposed the same, pytorch/pytorch#162999.)
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from launcher.job.logs import TICK

WINDOW_S = 1.0  # how long a line waits for the same text from other ranks (seconds)
RANK_LINE = re.compile(r"^(?P<label>.*?) \| \[rank(?P<rank>\d+)\]: (?P<text>.*)$", re.DOTALL)


@dataclass
class _Pending:
    """One line to show, or several ranks' alike: their labels and ranks, its text, when it came."""

    line: str  # as it came (shown as is when no other rank joins it)
    text: str | None  # the text after the rank prefix; None: a line without one, never merged
    since: float
    labels: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def shown(self) -> str:
        if len(self.ranks) < 2:
            return self.line
        label = self.labels[0] if len(set(self.labels)) == 1 else f"{len(set(self.labels))} nodes"
        return f"{label} | [ranks {rank_ranges(self.ranks)}]: {self.text}"


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5, 7, 8]`` -> ``0-3,5,7-8``."""
    out = []
    # Consecutive ranks keep the same difference to their index in the sorted list: one run each.
    for _, run in itertools.groupby(enumerate(sorted(set(ranks))), key=lambda pair: pair[1] - pair[0]):
        first, *rest = (rank for _, rank in run)
        out.append(f"{first}-{rest[-1]}" if rest else str(first))
    return ",".join(out)


def collapsed(lines: Iterable[str], clock: Callable[[], float] = time.monotonic) -> Iterator[str]:
    """``lines`` (each ending in a newline, or TICK) with alike rank lines merged (see the module).
    ``clock``: seconds, monotonic."""
    pending: list[_Pending] = []
    for line in lines:
        now = clock()
        if line != TICK:
            _add(pending, line, now)
        while pending and now - pending[0].since >= WINDOW_S:
            yield pending.pop(0).shown()
        if line == TICK:
            yield TICK
    yield from (p.shown() for p in pending)


def _add(pending: list[_Pending], line: str, now: float) -> None:
    match = RANK_LINE.match(line)
    if match is None:
        pending.append(_Pending(line, None, now, [line.partition(" | ")[0]]))
        return
    label, rank, text = match["label"], int(match["rank"]), match["text"]
    # Only into a group after this rank's (and its node's own) last line: each rank's order is kept.
    own = [k for k, p in enumerate(pending) if rank in p.ranks or (p.text is None and label in p.labels)]
    after = own[-1] + 1 if own else 0
    for group in pending[after:]:
        if group.text == text:
            group.labels.append(label)
            group.ranks.append(rank)
            return
    pending.append(_Pending(line, text, now, [label], [rank]))
