"""Goodput from the attempts' last heartbeats: training that counts, start-up, what failures cost."""

from __future__ import annotations

from pathlib import Path

from gptlaunch.contract import Beat, write_beat
from launcher.job.goodput import account, archived_beat


def _beat(time: float, start_step: int, at: int, **phase_s: float) -> Beat:
    return Beat(rank=0, local_rank=0, pid=1, step=at, phase="step", phase_since=0, time=time,
                start_step=start_step, phase_s=phase_s)  # fmt: skip


def test_a_failed_attempt_costs_the_gap_to_the_next_first_step_and_the_steps_redone() -> None:
    first = _beat(100, 0, 12, startup=5, step=12, checkpoint=1)  # failed at step 12, checkpoint at 10
    second = _beat(200, 10, 30, startup=4, step=20, eval=2)  # started at 200 - 26 = 174, stepping at 178
    g = account([first, second], wall_s=200)
    assert g.training_s == (12 - 12 * 2 / 12) + 20  # 2 of attempt 1's 12 steps were redone
    assert g.lost_s == 2 + (178 - 100)  # the redone steps, and its last beat → the next first step
    assert (g.startup_s, g.checkpoint_s, g.eval_s, g.failures, g.steps_redone) == (5, 1, 2, 1, [2])
    assert g.other_s == 200 - (30 + 80 + 5 + 1 + 2)
    assert g.describe().startswith(
        "goodput 15%: 30 s training of 3 min 20 s; start-up 5 s; lost 1 min 20 s to 1 failure (2 steps "
        "redone); checkpoint stalls 1 s"
    )


def test_a_next_attempt_still_starting_redoes_nothing_yet() -> None:
    """Its beats say start_step 0 until it has loaded its checkpoint: not "every step redone"."""
    first = _beat(100, 0, 40, startup=2, step=38)
    starting = Beat(rank=0, local_rank=0, pid=2, step=0, phase="startup", phase_since=104, time=105,
                    start_step=0, phase_s={"startup": 1.0})  # fmt: skip
    g = account([first, starting], wall_s=110)
    assert g.steps_redone == [0] and g.training_s == 38
    assert g.lost_s == 105 - 100  # from its last beat to the next attempt's latest beat, still starting
    resumed = Beat(**{**starting.__dict__, "phase": "step", "step": 41, "start_step": 35})
    assert account([first, resumed], wall_s=110).steps_redone == [5]
    # An attempt that died while starting: the one after it tells where the job resumed.
    g = account([first, starting, resumed], wall_s=110)
    assert g.steps_redone == [5, 0] and g.training_s == 38 * 35 / 40 + 0


def test_without_failures_nothing_is_lost_and_unknown_attempts_are_other(tmp_path: Path) -> None:
    g = account([_beat(60, 0, 50, startup=6, step=50)], wall_s=60)
    assert (g.training_s, g.lost_s, g.other_s, g.ratio) == (50, 0, 4, 50 / 60)
    assert "lost" not in g.describe()
    (tmp_path / "attempts" / "2" / "heartbeat" / "node-0").mkdir(parents=True)
    write_beat(tmp_path / "attempts" / "2" / "heartbeat" / "node-0", _beat(9, 0, 3, step=3))
    assert archived_beat(tmp_path, 1) is None  # attempt 1's stayed on a host
    assert (beat := archived_beat(tmp_path, 2)) is not None and beat.step == 3
