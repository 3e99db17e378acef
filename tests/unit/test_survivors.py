"""The console leaves to the node logs what the other nodes print once an attempt fails, from the
controller's fact in the status, whatever the lines' shape or order."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.job.logs import TICK
from launcher.job.record import Failing
from launcher.job.survivors import HOLD_S, left_to_logs, node_of


class _Timeline:
    """A clock and a status driven by the lines fed: ``(time, line)``, with the fact set from
    ``failing_from`` until ``cleared_at``."""

    def __init__(self, failing: Failing, failing_from: float, cleared_at: float = 1e9) -> None:
        self.now, self.failing, self.start, self.end = 0.0, failing, failing_from, cleared_at

    def feed(self, timed: list[tuple[float, str]]) -> Iterator[str]:
        for at, line in timed:
            self.now = at
            yield line

    def fact(self) -> Failing | None:
        return self.failing if self.start <= self.now < self.end else None


def _console(timed: list[tuple[float, str]], timeline: _Timeline) -> list[str]:
    return [line for line in left_to_logs(timeline.feed(timed), timeline.fact, lambda: timeline.now) if line]


def test_the_other_nodes_lines_since_shortly_before_the_failure_was_known_go_to_the_logs_only() -> None:
    node1 = Failing(attempt=1, node=1, at=0.0)
    timed = [
        (0.0, "node0 | [rank0]: step 1\n"),
        (1.0, "node1 | [rank1]: step 1\n"),
        (4.0, "node1 | [rank1]: ValueError: loss is nan\n"),  # the failed rank's own error: shown
        (4.1, "node0 | [rank0]: Traceback (most recent call last):\n"),  # a survivor, before it was known
        (4.2, "node0 | [rank0]: kept step 16's state in this host's memory\n"),  # any shape, any order
        (5.5, "node0 | [rank0]: RuntimeError: Connection closed by peer\n"),  # after: left out
        (6.0, TICK),
        (12.0, "node0 | [rank0]: step 17\n"),  # the next attempt (the fact cleared at 10): shown
        (16.0, TICK),
    ]
    shown = _console(timed, _Timeline(node1, failing_from=5.0, cleared_at=10.0))
    assert shown == [
        "node0 | [rank0]: step 1\n",
        "node1 | [rank1]: step 1\n",
        "node1 | [rank1]: ValueError: loss is nan\n",
        "node0 | [rank0]: step 17\n",
    ]


def test_after_a_hang_no_nodes_lines_are_shown_and_other_lines_pass() -> None:
    hang = Failing(attempt=1, node=None, at=0.0)
    timed = [
        (0.0, "node0 | step 1\n"),
        (8.0, "node0 | killed\n"),
        (8.0, "gpu-b node1 | killed\n"),
        (8.1, "x\n"),
    ]
    assert _console(timed, _Timeline(hang, failing_from=8.05)) == ["node0 | step 1\n", "x\n"]


def test_each_line_is_held_a_few_seconds_then_shown_in_order_and_all_at_the_end() -> None:
    timeline = _Timeline(Failing(attempt=1, node=0, at=0.0), failing_from=1e9)
    lines = left_to_logs(
        timeline.feed([(0.0, "a\n"), (1.0, TICK), (HOLD_S, "b\n")]), timeline.fact, lambda: timeline.now
    )
    assert next(lines) == TICK  # at 1 s: "a" is still held
    assert next(lines) == "a\n"  # released once HOLD_S passed
    assert list(lines) == ["b\n"]  # the stream's end releases what is held


def test_a_nodes_label_names_its_rank() -> None:
    assert [node_of(x) for x in ("node3 | a", "gl-h2 node1 | b", "launcher: x", "node | c")] == [
        3,
        1,
        None,
        None,
    ]
