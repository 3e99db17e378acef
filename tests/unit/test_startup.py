"""An attempt's start-up in parts: named by the rank (``runtime.starting``), published in its beat,
said by the console while a part lasts and all of them at the first step, and shown on the job page."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gptlaunch.contract import Beat, read_beats, write_beat
from gptlaunch.heartbeat import Heartbeat
from launcher.job import announce, startup
from launcher.job.announce import Announcer
from launcher.job.record import Attempt, JobRecord, JobStatus
from launcher.job.spec import JobSpec
from launcher.report.charts import describe
from launcher.report.facts import Span, with_startup
from tests.unit.plans import local_plan
from tests.unit.test_announce import said
from trainer.distributed import DistEnv


def test_the_heartbeat_publishes_each_part_in_order_until_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr("gptlaunch.heartbeat.time.time", lambda: clock[0])
    monkeypatch.setattr("gptlaunch.flight_recorder.start", lambda d, rank: None)
    beat = Heartbeat(DistEnv(rank=0, local_rank=0, world_size=1), tmp_path)
    clock[0] = 101.0
    beat.starting("data")
    clock[0] = 103.0
    beat.starting("compile", expect_s=38.0)
    (now,) = read_beats(tmp_path)
    assert (now.startup_s, now.expect_s) == ({"data": 2.0, "compile": 0.0}, 38.0)
    clock[0] = 110.0
    beat.step_done(1, 6.5)
    (first,) = read_beats(tmp_path)
    assert (
        first.phase == "step" and first.startup_s == {"data": 2.0, "compile": 7.0} and first.expect_s is None
    )
    beat.starting("late")  # after the first step: ignored, nothing published
    assert read_beats(tmp_path) == [first]
    # The launch is what came before the first part: here the attempt began 4 s before the heartbeat.
    assert startup.parts(first, started_at=96.0) == {"launch": 5.0, "data": 2.0, "compile": 7.0}


def _beat(
    at: float,
    first_step: float | None,
    startup_s: dict[str, float],
    began: float,
    expect_s: float | None = None,
) -> Beat:
    """Rank 0's beat at ``at`` of a process whose heartbeat started at ``began``, stepping since
    ``first_step`` (None: still starting up)."""
    phase_s = {"startup": (first_step or at) - began} | ({"step": at - first_step} if first_step else {})
    return Beat(rank=0, local_rank=0, pid=1, step=int(first_step is not None), time=at, phase_since=at,
                phase="step" if first_step else "startup", phase_s=phase_s, startup_s=startup_s,
                expect_s=expect_s)  # fmt: skip


def test_the_current_part_is_the_launch_until_the_rank_names_one() -> None:
    assert startup.current(None, 100.0, 103.0) == ("launch", 3.0, None)
    earlier = _beat(90.0, 85.0, {}, 80.0)  # the last attempt's
    assert startup.current(earlier, 100.0, 103.0) == ("launch", 3.0, None)
    compiling = _beat(105.0, None, {"data": 1.0, "compile": 0.5}, 103.0, expect_s=38.0)
    assert startup.current(compiling, 100.0, 109.5) == ("compile", 5.0, 38.0)
    assert startup.current(_beat(110.0, 109.0, {"compile": 5.0}, 103.0), 100.0, 111.0) is None


def test_the_console_names_a_part_that_lasts_once_then_every_part_at_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(announce, "READ_EVERY_S", 0.0)
    monkeypatch.setattr(announce, "HOLD_S", 0.0)  # said as late as the ranks' lines: none here
    spec = JobSpec.model_validate({"nnodes": 1})
    begun = time.time() - 10
    record = JobRecord.create(tmp_path / "job", spec, local_plan(spec, tmp_path / "job", tmp_path),
                              JobStatus(created_at=begun, started_at=begun))  # fmt: skip
    beats: dict[int, list[Beat]] = {}
    announcer = Announcer(record, lambda: beats)
    announcer.since = begun  # as a follower from the start
    assert said(announcer) == ["launcher: start-up: launch (10 s so far)"]
    beats[0] = [_beat(time.time(), None, {"data": 1.0, "compile": 3.0}, begun + 4, expect_s=38.0)]
    assert said(announcer) == ["launcher: start-up: compile (3 s so far, about 38 s expected)"]
    assert said(announcer) == []  # said once
    beats[0] = [_beat(begun + 60, begun + 50, {"data": 1.0, "compile": 40.0}, begun + 4)]
    assert said(announcer) == [
        "launcher: first step 50.0 s after the start: launch 9.0 s, data 1.0 s, compile 40.0 s"
    ]
    assert said(announcer) == []


def test_an_attempt_that_failed_before_its_first_step_was_said_says_it_before_its_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(announce, "READ_EVERY_S", 0.0)
    spec = JobSpec.model_validate({"nnodes": 1, "retries": 1})
    begun = time.time() - 30
    record = JobRecord.create(tmp_path / "job", spec, local_plan(spec, tmp_path / "job", tmp_path),
                              JobStatus(created_at=begun))  # fmt: skip
    announcer = Announcer(record, dict)
    announcer.since = begun
    write_beat(_mkdir(record.dir / "attempts" / "1" / "heartbeat" / "node-0"),
               _beat(begun + 9, begun + 6, {"data": 1.0}, begun + 2))  # fmt: skip
    failed = Attempt(
        number=1, started_at=begun, ended_at=begun + 10, exit_code=1, cause="rank 0 failed", step=3
    )
    record.update_status(attempts=[failed], started_at=begun + 12, attempt=2)
    first, retry = said(announcer)[:2]
    assert first == "launcher: first step 6.0 s after the start: launch 5.0 s, data 1.0 s", first
    assert retry.startswith("launcher: attempt 1 at step 3: "), retry


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def test_the_job_page_gives_each_attempt_its_start_up() -> None:
    spans = [
        Span(1, 100.0, 160.0, "failed", "rank 1 killed", 32, ""),
        Span(2, 170.0, None, "running", "", None, ""),
    ]
    beats = [_beat(150.0, 126.0, {"compile": 20.0}, 104.0), _beat(172.0, None, {}, 171.0)]
    first, second = with_startup(spans, beats)
    assert first.startup == {"launch": 6.0, "compile": 20.0} and second.startup == {}  # still starting
    assert describe(first).endswith("; first step 26.0 s after the start: launch 6.0 s, compile 20.0 s")
