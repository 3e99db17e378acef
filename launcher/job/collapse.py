"""The console's view of lines that several ranks print alike: one line naming the ranks.

At scale every rank prints the same warning, and 64 copies bury the one line that differs. A followed
line ``LABEL | [rankR]: TEXT`` waits up to WINDOW_S for the same TEXT from other ranks; then it is
shown once, as ``LABEL | [ranks 0-7]: TEXT`` (``N nodes | ...`` when the ranks are on several nodes).
A line that differs is never merged, so the first differing line is always shown; each rank's order
is kept (two ranks' lines may swap: their order means nothing), every line is shown at most WINDOW_S
late, and the node logs keep every line as it was.
(torchrun's maintainers proposed the same, pytorch/pytorch#162999.)

Each line comes out as a ``Collapsed``: the text shown, and the lines it stands for with when each
came (``members``), for the console's next stage (``launcher.job.survivors``), which holds lines a
while anyway: its hold counts from when each member came, so the two waits overlap.
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


class Collapsed(str):
    """A line as shown, with the lines it stands for and when each came (``members``, by ``clock``)."""

    members: tuple[tuple[float, str], ...]

    def __new__(cls, shown: str, members: Iterable[tuple[float, str]]) -> Collapsed:
        line = super().__new__(cls, shown)
        line.members = tuple(members)
        return line


def members(line: str, now: float) -> tuple[tuple[float, str], ...]:
    """The lines ``line`` stands for, with when each came: its own, come ``now``, when it is not a
    ``Collapsed``."""
    return line.members if isinstance(line, Collapsed) else ((now, line),)


def merged(lines: list[str]) -> str:
    """One line for ``lines``, rank lines of one text (``[rankR]: TEXT``) in order of their ranks'
    first line: the line itself when there is one."""
    if len(lines) < 2:
        return lines[0]
    found = [RANK_LINE.match(line) for line in lines]
    labels = [m["label"] for m in found if m is not None]
    label = labels[0] if len(set(labels)) == 1 else f"{len(set(labels))} nodes"
    text = found[0]["text"] if found[0] is not None else lines[0]
    return f"{label} | [ranks {rank_ranges(int(m['rank']) for m in found if m is not None)}]: {text}"


@dataclass
class _Pending:
    """One line to show, or several ranks' alike: its label (the first's), ranks, text, when it came."""

    text: str | None  # the text after the rank prefix; None: a line without one, never merged
    since: float
    label: str
    ranks: list[int] = field(default_factory=list)
    members: list[tuple[float, str]] = field(default_factory=list)  # the lines it stands for, timed

    def shown(self) -> Collapsed:
        return Collapsed(merged([line for _, line in self.members]), self.members)


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5, 7, 8]`` -> ``0-3,5,7-8``."""
    out = []
    # Consecutive ranks keep the same difference to their index in the sorted list: one run each.
    for _, run in itertools.groupby(enumerate(sorted(set(ranks))), key=lambda pair: pair[1] - pair[0]):
        first, *rest = (rank for _, rank in run)
        out.append(f"{first}-{rest[-1]}" if rest else str(first))
    return ",".join(out)


def collapsed(lines: Iterable[str], clock: Callable[[], float] = time.monotonic) -> Iterator[str]:
    """``lines`` (each ending in a newline, or TICK) with alike rank lines merged (see the module),
    each a ``Collapsed``. ``clock``: seconds, monotonic."""
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
        pending.append(_Pending(None, now, line.partition(" | ")[0], members=[(now, line)]))
        return
    label, rank, text = match["label"], int(match["rank"]), match["text"]
    # This rank's lines waiting (and its node's own): they stay in order. A rank's line that stands
    # alone may move up past other ranks' lines to let this line join the same text further up (the
    # order of two ranks' lines means nothing: torchrun tails each rank's output on its own); a merged
    # one stays, and so does a line of the node's own (it follows all of the node's ranks' lines).
    own = [k for k, p in enumerate(pending) if rank in p.ranks or (p.text is None and label == p.label)]
    floor = max((k + 1 for k in own if pending[k].text is None or len(pending[k].members) > 1), default=0)
    for at in range(floor, len(pending)):
        group = pending[at]
        if group.text == text and rank not in group.ranks:
            moved = [pending.pop(k) for k in reversed(own) if k > at][::-1]
            for p in moved:  # shown before the group: no later than it
                p.since = min(p.since, group.since)
            pending[at:at] = moved
            group.ranks.append(rank)
            group.members.append((now, line))
            return
    pending.append(_Pending(text, now, label, [rank], [(now, line)]))
