"""A followed job's retries are said in one line each, from the record: what failed, where, at which
step, when the next attempt starts; then the step that attempt resumed at, from its rank 0's beat."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from gptlaunch.contract import Beat
from launcher.job import announce
from launcher.job.announce import Announcer
from launcher.job.record import Attempt, Failure, JobRecord, JobStatus
from launcher.job.spec import JobSpec
from tests.unit.plans import local_plan

KILLED = Failure(node_rank=1, rank=1, error="rank 1 was killed by SIGKILL; see JOB/node-1.log")


def _beat(at: float, start_step: int) -> Beat:
    return Beat(rank=0, local_rank=0, pid=1, step=start_step + 1, phase="step", phase_since=at, time=at,
                start_step=start_step)  # fmt: skip


def said(announcer: Announcer) -> list[str]:
    """What the announcer says once the beats it asked for (in its thread) have answered."""
    out = announcer.lines()
    while announcer._asking is not None:
        announcer._asking.join()
        out += announcer.lines()
    return out


def test_a_retry_is_one_line_then_the_step_it_resumed_at(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(announce, "READ_EVERY_S", 0.0)
    spec = JobSpec.model_validate({"nnodes": 2, "retries": 2, "retry_backoff_s": 10})
    record = JobRecord.create(tmp_path / "job", spec, local_plan(spec, tmp_path / "job", tmp_path),
                              JobStatus(created_at=time.time()))  # fmt: skip
    beats: dict[int, list[Beat]] = {0: [_beat(50.0, 0)]}
    announcer = Announcer(record, lambda: beats)
    assert said(announcer) == []  # nothing ended yet
    ended = Attempt(number=1, started_at=40, ended_at=100, cleaned_at=101, exit_code=1,
                    cause=KILLED.summary(), step=32, replaced={"gl-h2": "gl-h3"})  # fmt: skip
    record.update_status(attempts=[ended])
    (line,) = said(announcer)
    assert line.startswith("launcher: attempt 1 at step 32: ") and "rank 1" in line, line
    assert line.endswith("gl-h2 → replaced by gl-h3; attempt 2 of 3 starts now"), line
    assert said(announcer) == []  # said once; attempt 1's beat is not the next attempt's
    beats[0] = [dataclasses.replace(_beat(110.0, 0), phase="startup")]
    assert said(announcer) == []  # starting up: its checkpoint is not loaded yet
    beats[0] = [_beat(120.0, 30)]
    assert said(announcer) == ["launcher: attempt 2 of 3 resumed at step 30"]
    assert said(announcer) == []
    again = ended.model_copy(update={"number": 2, "step": 31, "replaced": {}})  # no step past 32
    record.update_status(attempts=[ended, again])
    assert said(announcer)[0].endswith("attempt 3 of 3 starts in 10 s")


def test_a_job_without_retries_says_nothing_and_a_late_follower_only_what_is_new(tmp_path: Path) -> None:
    for retries, job in ((0, "once"), (1, "late")):
        spec = JobSpec.model_validate({"nnodes": 1, "retries": retries})
        record = JobRecord.create(tmp_path / job, spec, local_plan(spec, tmp_path / job, tmp_path),
                                  JobStatus(created_at=time.time()))  # fmt: skip
        ended = Attempt(number=1, started_at=0, ended_at=1, exit_code=1, cause=KILLED.summary())
        if retries:  # the attempt ended before this follower started: `launcher submit --wait` later
            record.update_status(attempts=[ended])
        assert said(Announcer(record, dict)) == []
