"""The job's numbers in TensorBoard (``launcher.job.scalars``), read back with TensorBoard's own event
reader: what a user's TensorBoard shows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gptlaunch.contract import Beat
from launcher.job.goodput import Goodput
from launcher.job.progress import STRAGGLER_RATIO
from launcher.job.scalars import PARTS, JobScalars, read_rank_compute, scalars_dir, tensorboard_command
from tests.unit.test_report import gate_result


def _read(job_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(scalars_dir(job_dir)), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_attempts_and_goodput_are_scalars_by_seconds_since_submit_and_the_cause_is_text(
    tmp_path: Path,
) -> None:
    origin = 1_000.0
    scalars = JobScalars(tmp_path, origin)
    scalars.attempt(1, 2, "", origin + 3.2)
    goodput = Goodput(wall_s=90, training_s=60, startup_s=5, lost_s=10, checkpoint_s=4, eval_s=6,
                      other_s=5, failures=1, steps_redone=[2])  # fmt: skip
    scalars.goodput(goodput, origin + 90.7, attempt=1)
    scalars.attempt(2, 2, "rank 1 (node 1) was killed by SIGKILL", origin + 95.0)
    scalars.close()

    events = _read(tmp_path)
    attempts = events.Scalars("job/attempt")
    assert [(e.step, e.value) for e in attempts] == [(3, 1.0), (90, 1.0), (95, 2.0)]
    assert [e.value for e in events.Scalars("job/failures")] == [0.0, 1.0]
    assert attempts[2].wall_time == pytest.approx(origin + 95.0)
    ratio = events.Scalars("goodput/ratio")
    assert [e.step for e in ratio] == [90]
    assert ratio[0].value == pytest.approx(60 / 90, rel=1e-6)  # stored as float32
    for part in PARTS:
        assert events.Scalars(f"goodput/{part}")[0].value == pytest.approx(getattr(goodput, part))
    (first, second) = events.Tensors("job/attempts")
    assert first.tensor_proto.string_val == [b"attempt 1 of 2 started"]
    assert second.tensor_proto.string_val == [
        b"attempt 2 of 2 started after: rank 1 (node 1) was killed by SIGKILL"
    ]


def _beat(rank: int, compute_s: float | None) -> Beat:
    return Beat(rank=rank, local_rank=0, pid=1, step=7, phase="train", phase_since=0.0, time=1.0,
                compute_s=compute_s)  # fmt: skip


def test_each_ranks_compute_time_its_spread_and_the_straggler_flag_are_scalars(tmp_path: Path) -> None:
    """Rank 2 computes at 3× the others' median, over STRAGGLER_RATIO: flagged, and only it; rank 3,
    not yet timed, has no point."""
    assert 3.0 > STRAGGLER_RATIO > 1.1
    scalars = JobScalars(tmp_path, 0.0)
    scalars.ranks([_beat(0, 0.1), _beat(1, 0.11), _beat(2, 0.3), _beat(3, None)], 30.0)
    scalars.ranks([_beat(0, None)], 45.0)  # nobody timed (a new attempt): no point
    scalars.close()
    events = _read(tmp_path)
    tags = set(events.Tags()["scalars"])
    assert {f"ranks/compute_s/rank_{r}" for r in range(3)} <= tags and "ranks/compute_s/rank_3" not in tags
    assert events.Scalars("ranks/compute_s/rank_2")[0].value == pytest.approx(0.3)
    assert [events.Scalars(f"ranks/straggler/rank_{r}")[0].value for r in range(3)] == [0.0, 0.0, 1.0]
    assert [(e.step, e.value) for e in events.Scalars("ranks/stragglers")] == [(30, 1.0)]
    assert events.Scalars("ranks/compute_spread")[0].value == pytest.approx(0.3 / 0.1)
    read = read_rank_compute(tmp_path)  # what the report draws
    assert sorted(read) == [0, 1, 2] and read[2] == [(30.0, pytest.approx(0.3))]
    assert read_rank_compute(tmp_path / "none") == {}


def test_a_job_record_that_cannot_hold_the_event_file_costs_the_job_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "tensorboard").write_text("a file where the directory would be")
    scalars = JobScalars(tmp_path, 0.0)
    scalars.attempt(1, 1, "", 1.0)  # no error: the job goes on
    scalars.close()
    assert "job scalars in TensorBoard: none from now on" in caplog.text


def test_the_health_gates_figures_are_scalars_named_by_host(tmp_path: Path) -> None:
    scalars = JobScalars(tmp_path, 0.0)
    scalars.health(gate_result(slow_link="h2", slow_device="h3"), ["h1", "h2", "h3"], 4.0)
    scalars.close()
    events = _read(tmp_path)
    links = {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"] if "busbw" in tag}
    assert links == pytest.approx({
        "health/busbw_gbs/h1-h2": 0.05, "health/busbw_gbs/h2-h3": 0.05, "health/busbw_gbs/h3-h1": 1.0
    })  # fmt: skip
    assert events.Scalars("health/tflops/h3-rank_2")[0].value == pytest.approx(0.1)
    assert events.Scalars("health/tflops/h1-rank_0")[0].step == 4


def test_without_tensorboard_the_points_end_with_one_warning_and_the_job_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    scalars = JobScalars(tmp_path, 0.0)
    monkeypatch.setitem(sys.modules, "tensorboard.compat.proto.summary_pb2", None)  # import fails
    scalars.attempt(1, 1, "", 1.0)
    scalars.health(gate_result(slow_link="h2", slow_device="h3"), ["h1"], 2.0)  # too few names: no error
    scalars.close()
    assert not scalars.active
    assert caplog.text.count("none from now on") == 1, caplog.text


def test_the_tensorboard_command_is_one_logdir_when_the_run_dir_is_the_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    job = Path("jobs") / "gpt-1"  # a relative --jobs-root, the default
    assert tensorboard_command(job, str(tmp_path / "jobs" / "gpt-1" / "run")) == (
        f"tensorboard --logdir {tmp_path}/jobs/gpt-1"
    )
    assert tensorboard_command(job, "/runs/a") == (
        f"tensorboard --logdir_spec job:{tmp_path}/jobs/gpt-1/tensorboard/job,trainer:/runs/a/tensorboard"
    )
