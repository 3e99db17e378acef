"""The straggler verdict (pure) and this rank's compute clock."""

from __future__ import annotations

import time

import torch

from trainer.stragglers import (
    INTERVALS,
    THRESHOLD,
    ComputeClock,
    Straggler,
    Stragglers,
    StragglerWatch,
    describe,
)


def test_a_rank_is_named_after_three_slow_intervals_in_a_row_and_forgotten_when_it_recovers() -> None:
    verdict = Stragglers(world_size=4)
    slow = [1.0, 1.9, 1.0, 1.1]
    for _ in range(INTERVALS - 1):
        assert verdict.update(slow) == []
    assert verdict.update(slow) == [Straggler(rank=1, ratio=1.9 / 1.0)]  # the others' median: 1.0
    assert verdict.update([1.0, 1.0, 1.0, 1.0]) == []  # recovered: the streak starts over
    assert verdict.update(slow) == []


def test_an_interrupted_streak_or_a_ratio_at_the_threshold_names_nobody() -> None:
    verdict = Stragglers(world_size=3)
    at_threshold = [1.0, THRESHOLD, 1.0]  # the others' median 1.0: exactly at the threshold is not slower
    for _ in range(INTERVALS + 2):
        assert verdict.update(at_threshold) == []
    for seconds in ([1.0, 2.0, 1.0], [1.0, 2.0, 1.0], [1.0, 1.1, 1.0], [1.0, 2.0, 1.0]):
        assert verdict.update(seconds) == []
    assert verdict.update([0.0, 0.0, 0.0]) == []  # no step timed in the interval


def test_the_clock_times_only_what_runs_inside_forward() -> None:
    clock = ComputeClock(torch.device("cpu"))
    for _ in range(2):
        with clock.forward():
            time.sleep(0.02)
        time.sleep(0.05)  # outside: a backward that waits for a slow peer
        clock.step_done()
    mean = clock.take()
    # At least the 0.02 s inside; below 0.02 + 0.05, which counting the time outside would reach
    # (a loaded machine only lengthens each sleep, so the bound holds whatever the overshoot inside).
    assert 0.02 <= mean < 0.07, mean
    assert clock.take() == 0.0  # a new interval, no step yet


def test_each_ranks_throughput_is_its_share_of_a_step_over_its_forward_time() -> None:
    watch = StragglerWatch(torch.device("cpu"), world_size=2)
    assert watch.rank_tokens_per_s(4096) == []  # no interval yet
    watch.last = [0.5, 2.0]
    assert watch.rank_tokens_per_s(4096) == [4096.0, 1024.0]  # 2048 tokens a step each
    watch.last = [0.5, 0.0]
    assert watch.rank_tokens_per_s(4096) == [4096.0, 0.0]  # a rank that timed nothing


def test_the_console_line_names_rank_node_host_and_ratio() -> None:
    line = describe({"rank": 1, "node": 1, "host": "gl-h2", "ratio": 1.91})
    assert line.startswith("straggler: rank 1 on node 1 (gl-h2) at 1.9× the median step time")
