"""A SLURM job's numbers in TensorBoard (``launcher.schedulers.slurm.points``), written by node 0's task
from the shared job record and read back with TensorBoard's own event reader."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gptlaunch.contract import Beat, write_beat
from launcher.job.hang import heartbeat_dir
from launcher.job.record import Attempt, JobRecord, JobStatus
from launcher.job.scalars import scalars_dir
from launcher.job.spec import JobSpec
from launcher.schedulers.slurm.points import AttemptPoints
from tests.unit.plans import local_plan


def test_node_0s_task_writes_its_attempt_with_the_cause_before_it_goodput_and_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 2 of 3, after attempt 1's failure, with no start recorded (only `launcher status`
    records it): SLURM's start of the job stands in."""
    now = time.time()
    monkeypatch.setenv("SLURM_JOB_START_TIME", str(int(now - 100)))
    spec = JobSpec.model_validate({"nnodes": 2, "retries": 2})
    failed = Attempt(
        number=1, started_at=now - 90, ended_at=now - 40, exit_code=1, cause="node 1 was lost", step=9
    )
    status = JobStatus(created_at=now - 120, attempt=2, attempts=[failed])
    record = JobRecord.create(tmp_path / "job", spec, local_plan(spec, tmp_path / "job", tmp_path), status)
    for node, compute_s in ((0, 0.1), (1, 0.4)):
        beats = heartbeat_dir(record.dir, node)
        beats.mkdir(parents=True)
        beat = Beat(rank=node, local_rank=0, pid=1, step=20, phase="step", phase_since=now - 30, time=now,
                    compute_s=compute_s, start_step=9, phase_s={"startup": 5.0, "step": 25.0})  # fmt: skip
        write_beat(beats, beat)
    points = AttemptPoints(record.dir)
    points.start()
    points.stop()  # the last point: goodput and the ranks as of now

    events = EventAccumulator(str(scalars_dir(record.dir)), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    (line,) = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("job/attempts")]
    assert line == "attempt 2 of 3 started after: node 1 was lost"
    (ratio,) = events.Scalars("goodput/ratio")
    (wall,) = events.Scalars("goodput/wall_s")
    assert wall.value == pytest.approx(100, abs=2)  # from SLURM's start of the job
    assert ratio.value == pytest.approx(25 / wall.value, rel=1e-5)  # the last attempt's steps: none redone
    assert [events.Scalars(f"ranks/straggler/rank_{rank}")[0].value for rank in (0, 1)] == [0.0, 1.0]


def test_a_job_dir_without_a_record_gets_no_points_and_the_node_goes_on(tmp_path: Path) -> None:
    """The standalone sbatch script's job dir holds no spec: nothing is written, nothing is raised."""
    points = AttemptPoints(tmp_path)
    points.start()
    points.stop()
    assert not scalars_dir(tmp_path).exists()
