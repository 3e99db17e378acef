"""Statistics over ranks that the trainer and the launcher share (imports nothing heavy)."""

from __future__ import annotations

from collections.abc import Sequence


def ratios_to_others(seconds: Sequence[float]) -> list[float]:
    """Each value of ``seconds`` (one per rank) over the median of the *other* ranks' values, in the
    same order: a slow rank does not pull its own baseline up (with two ranks the plain median is their
    mean, and a rank at half speed would show as only 1.33×). 0.0 where that median is not positive or
    there is no other rank. O(n log n): one sort, each median read from it."""
    order = sorted(range(len(seconds)), key=lambda k: seconds[k])
    ranked = [seconds[k] for k in order]
    ratios = [0.0] * len(seconds)
    for position, k in enumerate(order):
        median = _median_without(ranked, position)
        ratios[k] = seconds[k] / median if median > 0 else 0.0
    return ratios


def _median_without(ranked: list[float], position: int) -> float:
    """The median of the sorted ``ranked`` without the value at ``position`` (0.0 when none is left)."""
    rest = len(ranked) - 1
    if rest < 1:
        return 0.0

    def at(j: int) -> float:
        return ranked[j if j < position else j + 1]

    return at(rest // 2) if rest % 2 else (at(rest // 2 - 1) + at(rest // 2)) / 2
