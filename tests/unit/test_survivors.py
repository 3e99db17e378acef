"""The console leaves to the node logs what follows from a failure, from the controller's facts in
the status (the attempt failing, then the rank its verdict named), whatever the lines' shape or
order."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.job.collapse import collapsed
from launcher.job.logs import TICK
from launcher.job.record import Attempt, Failing, Failure, JobStatus
from launcher.job.survivors import DECIDE_MAX_S, HOLD_S, left_to_logs, node_of

FOUND = Failing(attempt=1, at=0.0)  # before the verdict
NAMED = FOUND.model_copy(update={"decided": True, "node": 1, "rank": 1})  # rank 1 on node 1


class _Timeline:
    """A clock and a status driven by the lines fed (``(time, line)``): from each time in ``facts``
    on, the status that goes with it."""

    def __init__(self, facts: list[tuple[float, JobStatus]]) -> None:
        self.now, self.facts = 0.0, facts

    def feed(self, timed: list[tuple[float, str]]) -> Iterator[str]:
        for at, line in timed:
            self.now = at
            yield line

    def status(self) -> JobStatus:
        now = [status for at, status in self.facts if at <= self.now]
        return now[-1] if now else JobStatus(created_at=0.0)


def _status(
    failing: Failing | None = None, attempt: int = 1, attempts: list[Attempt] | None = None
) -> JobStatus:
    return JobStatus(created_at=0.0, failing=failing, attempt=attempt, attempts=attempts or [])


def _console(timed: list[tuple[float, str]], timeline: _Timeline) -> list[str]:
    lines = left_to_logs(timeline.feed(timed), timeline.status, lambda: timeline.now)
    return [line for line in lines if line]


KILLED = [
    (0.0, "node0 | [rank0]: step 1\n"),
    (1.0, "node1 | [rank1]: step 1\n"),
    (4.0, "node1 | [rank1]: ValueError: loss is nan\n"),  # the failed rank's own error: shown
    (4.1, "node0 | [rank0]: Traceback (most recent call last):\n"),  # a survivor, before it was known
    (4.2, "node0 | [rank0]: kept step 16's state in this host's memory\n"),  # any shape, any order
    (4.5, "node0 | [rank0]: RuntimeError: Connection closed by peer\n"),
    (4.6, "node1 | torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"),  # its torchrun
    (5.0, TICK),
    (6.0, TICK),
    (12.0, "node0 | [rank0]: step 17\n"),  # the next attempt: shown
    (16.0, TICK),
]
SHOWN = [
    "node0 | [rank0]: step 1\n",
    "node1 | [rank1]: step 1\n",
    "node1 | [rank1]: ValueError: loss is nan\n",
    "node0 | [rank0]: step 17\n",
]


def test_only_the_failed_ranks_lines_since_shortly_before_the_failure_was_known_reach_the_console() -> None:
    facts = [(5.0, _status(FOUND)), (8.0, _status(NAMED)), (10.0, _status(NAMED, attempt=2))]
    assert _console(KILLED, _Timeline(facts)) == SHOWN


def test_a_verdict_missed_between_two_reads_is_taken_from_the_archived_attempt() -> None:
    archived = Attempt(
        number=1, started_at=0, ended_at=6, exit_code=1, cause="x", failure=Failure(node_rank=1, rank=1)
    )
    facts = [(5.0, _status(FOUND)), (10.0, _status(FOUND, attempt=2, attempts=[archived]))]
    assert _console(KILLED, _Timeline(facts)) == SHOWN


def test_lines_wait_for_the_verdict_and_a_failure_that_turned_out_a_stop_hides_nothing() -> None:
    came = 5.0 - HOLD_S / 2  # held when the failure is found
    timed = [(came, "node0 | a\n"), (5.0, TICK), (came + HOLD_S + 0.1, TICK), (8.0, TICK)]
    timeline = _Timeline([(5.0, _status(FOUND)), (8.0, _status(None))])
    lines = left_to_logs(timeline.feed(timed), timeline.status, lambda: timeline.now)
    assert next(lines) == TICK  # at 5 s: not due
    assert next(lines) == TICK  # due, but the failure is not decided yet
    assert next(lines) == "node0 | a\n"  # at 8 s: a stop, the fact went: nothing is left out
    assert list(lines) == [TICK]


def test_after_a_hang_or_an_undecided_failure_no_node_line_is_shown_and_other_lines_pass() -> None:
    hang = FOUND.model_copy(update={"decided": True})  # no rank named
    timed = [(0.0, "node0 | step 1\n"), (8.0, "node0 | killed\n"), (8.0, "gpu-b node1 | [rank1]: killed\n"),
             (8.1, "launcher: x\n")]  # fmt: skip
    assert _console(timed, _Timeline([(8.05, _status(hang))])) == ["node0 | step 1\n", "launcher: x\n"]
    late = [*timed, (8.3, TICK), (8.3 + DECIDE_MAX_S + 1, TICK)]  # the verdict never came
    assert _console(late, _Timeline([(8.05, _status(FOUND))])) == ["node0 | step 1\n", "launcher: x\n"]


def test_each_line_is_held_a_few_seconds_then_shown_in_order_and_all_at_the_end() -> None:
    timeline = _Timeline([])
    lines = left_to_logs(
        timeline.feed([(0.0, "a\n"), (1.0, TICK), (HOLD_S, "b\n")]), timeline.status, lambda: timeline.now
    )
    assert next(lines) == TICK  # at 1 s: "a" is still held
    assert next(lines) == "a\n"  # released once HOLD_S passed
    assert list(lines) == ["b\n"]  # the stream's end releases what is held


def test_a_lines_label_names_its_node_and_rank() -> None:
    lines = ("node3 | [rank5]: a", "gl-h2 node1 | b", "launcher: x", "node | c")
    assert [node_of(x) for x in lines] == [(3, 5), (1, None), None, None]


def test_a_failure_and_its_retry_between_two_reads_still_leave_the_aftermath_to_the_logs() -> None:
    archived = Attempt(
        number=1, started_at=0, ended_at=6, exit_code=1, cause="x", failure=Failure(node_rank=1, rank=1)
    )
    # failing, decided and retried between the reads at 4.5 s and 5 s
    facts = [(4.55, _status(NAMED, attempt=2, attempts=[archived]))]
    assert _console(KILLED, _Timeline(facts)) == SHOWN


def _collapsed_console(timed: list[tuple[float, str]], timeline: _Timeline) -> list[tuple[float, str]]:
    """(when shown, line) through the console's two holds: alike lines merged, then the aftermath."""
    clock = lambda: timeline.now  # noqa: E731
    lines = left_to_logs(collapsed(timeline.feed(timed), clock), timeline.status, clock)
    return [(timeline.now, line) for line in lines if line]


def test_alike_lines_are_merged_within_the_hold_and_a_lone_line_waits_only_the_hold() -> None:
    timed = [(0.0, "node0 | [rank0]: warning: x\n"), (0.3, "node1 | [rank1]: warning: x\n"),
             (0.5, "node0 | [rank0]: step 1\n")]  # fmt: skip
    timed += [(t / 10, TICK) for t in range(6, 40)]
    assert _collapsed_console(timed, _Timeline([])) == [
        (0.3 + HOLD_S, "2 nodes | [ranks 0-1]: warning: x\n"),  # counted from its last line
        (0.5 + HOLD_S, "node0 | [rank0]: step 1\n"),  # not HOLD_S + WINDOW_S
    ]


def test_a_merged_line_in_a_failures_aftermath_is_shown_as_the_failed_ranks_own() -> None:
    timed = [(4.0, "node1 | [rank1]: RuntimeError: x\n"), (4.1, "node0 | [rank0]: RuntimeError: x\n")]
    timed += [(t / 10, TICK) for t in range(42, 80)]
    facts = [(4.2, _status(FOUND)), (4.4, _status(NAMED))]
    shown = [line for _, line in _collapsed_console(timed, _Timeline(facts))]
    assert shown == ["node1 | [rank1]: RuntimeError: x\n"]
