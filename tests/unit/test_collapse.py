"""Lines that several ranks print alike are shown once on the console, naming the ranks; the line that
differs is shown as it came, each rank's order and each node's own lines' place are kept, and nothing
waits more than WINDOW_S."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.job.collapse import WINDOW_S, collapsed, rank_ranges
from launcher.job.logs import TICK


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fed(clock: Clock, timed: list[tuple[float, str]]) -> Iterator[str]:
    for at, line in timed:
        clock.now = at
        yield line


def _shown(timed: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """(when it was shown, line) for each line shown, ticks left out."""
    clock = Clock()
    return [(clock.now, line) for line in collapsed(_fed(clock, timed), clock) if line != TICK]


def test_rank_ranges_are_compact() -> None:
    assert rank_ranges([3, 0, 1, 2, 5, 7, 8]) == "0-3,5,7-8"
    assert rank_ranges([4]) == "4"


def test_eight_ranks_alike_are_one_line_and_the_one_that_differs_is_shown() -> None:
    warning = "UserWarning: TypedStorage is deprecated\n"
    timed = [(0.01 * r, f"node{r // 4} | [rank{r}]: {warning}") for r in range(8) if r != 6]
    timed.append((0.06, "node1 | [rank6]: RuntimeError: NCCL error\n"))
    timed.append((1.0, TICK))
    assert _shown(timed) == [
        (1.0, f"2 nodes | [ranks 0-5,7]: {warning}"),
        (1.0, "node1 | [rank6]: RuntimeError: NCCL error\n"),
    ]


def test_ranks_of_one_node_keep_its_label() -> None:
    timed = [(0.0, "gl-h1 node0 | [rank0]: data: ready\n"), (0.1, "gl-h1 node0 | [rank1]: data: ready\n")]
    assert [line for _, line in _shown(timed)] == ["gl-h1 node0 | [ranks 0-1]: data: ready\n"]


def test_a_lone_line_waits_no_longer_than_the_window_and_order_is_kept() -> None:
    timed = [
        (0.0, "node0 | [rank0]: step 1 | loss 9.0\n"),
        (0.2, "node0 | agent: torchrun started\n"),
        (0.2 + WINDOW_S / 2, TICK),
        (WINDOW_S, TICK),
        (0.2 + WINDOW_S, TICK),
    ]
    assert _shown(timed) == [
        (WINDOW_S, "node0 | [rank0]: step 1 | loss 9.0\n"),
        (0.2 + WINDOW_S, "node0 | agent: torchrun started\n"),
    ]


def test_the_same_rank_twice_is_two_lines_and_the_end_of_the_stream_shows_what_waits() -> None:
    line = "node0 | [rank0]: retrying\n"
    assert _shown([(0.0, line), (0.1, line)]) == [(0.1, line), (0.1, line)]


def test_a_line_joins_a_group_further_up_only_behind_its_ranks_own_earlier_lines() -> None:
    # both ranks raise the same error through different frames: rank 1's frames stay before its error
    rank0 = ["Traceback (most recent call last):\n", '  File "train.py", line 10\n', "ValueError: bad\n"]
    rank1 = ["Traceback (most recent call last):\n", '  File "train.py", line 12\n', "ValueError: bad\n"]
    timed = [(0.0, f"node0 | [rank0]: {text}") for text in rank0]
    timed += [(0.1, f"node1 | [rank1]: {text}") for text in rank1]
    shown = [line for _, line in _shown(timed)]
    mine = [line for line in shown if "rank1" in line or "ranks 0-1" in line]
    assert [line.split(": ", 1)[1] for line in mine] == rank1, shown
    assert shown[0] == "2 nodes | [ranks 0-1]: Traceback (most recent call last):\n", shown


def test_a_ranks_line_moves_up_past_other_ranks_to_let_its_next_line_join_theirs() -> None:
    # rank 0's output was read after rank 1's: its own line moves up, its warning joins rank 1's
    timed = [
        (0.00, "node1 | [rank1]: rank 1/2 on vm\n"),
        (0.01, "node1 | [rank1]: trainer: warning: fp16 runs in bf16\n"),
        (0.10, "node0 | [rank0]: rank 0/2 on vm\n"),
        (0.11, "node0 | [rank0]: trainer: warning: fp16 runs in bf16\n"),
        (0.12, "node0 | [rank0]: training: world_size=2\n"),
        (0.01 + WINDOW_S, TICK),
        (0.12 + WINDOW_S, TICK),
    ]
    assert _shown(timed) == [
        (0.01 + WINDOW_S, "node1 | [rank1]: rank 1/2 on vm\n"),
        (0.01 + WINDOW_S, "node0 | [rank0]: rank 0/2 on vm\n"),  # no later than the line it now precedes
        (0.01 + WINDOW_S, "2 nodes | [ranks 0-1]: trainer: warning: fp16 runs in bf16\n"),
        (0.12 + WINDOW_S, "node0 | [rank0]: training: world_size=2\n"),
    ]


def test_a_merged_line_of_the_rank_stays_and_what_follows_it_joins_nothing_before_it() -> None:
    # rank 0's "ready" is merged with rank 2's: rank 0's next line cannot join a group before it
    timed = [
        (0.0, "node1 | [rank1]: done\n"),
        (0.1, "node0 | [rank0]: ready\n"),
        (0.2, "node2 | [rank2]: ready\n"),
        (0.3, "node0 | [rank0]: done\n"),
    ]
    shown = [line for _, line in _shown(timed)]
    assert shown == ["node1 | [rank1]: done\n", "2 nodes | [ranks 0,2]: ready\n", "node0 | [rank0]: done\n"]


def test_a_line_of_the_nodes_own_stays_after_its_ranks_lines() -> None:
    # the agent's line about rank 1 follows rank 1's error in node 0's log: rank 0 cannot move it up
    timed = [
        (0.0, "node1 | [rank2]: X\n"),
        (0.1, "node0 | [rank1]: Traceback: boom\n"),
        (0.2, "node0 | agent: worker rank 1 exited 1\n"),
        (0.3, "node0 | [rank0]: X\n"),
    ]
    assert [line for _, line in _shown(timed)] == [
        "node1 | [rank2]: X\n",
        "node0 | [rank1]: Traceback: boom\n",
        "node0 | agent: worker rank 1 exited 1\n",
        "node0 | [rank0]: X\n",
    ]
