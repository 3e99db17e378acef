"""The hang watchdog's pure parts: budgets per phase, the stall verdict, reading a py-spy stack and
the one-line cause; and the trainer's heartbeat file, written and read back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gptlaunch.contract import Beat, read_beats, write_beat
from gptlaunch.heartbeat import Heartbeat
from launcher.job import reports
from launcher.job.hang import (
    FLOOR_S,
    STEP_FACTOR,
    Collective,
    HangReport,
    HangSpec,
    RankReport,
    Stall,
    hang_message,
    heartbeat_dir,
    merge,
    stalled,
)
from launcher.job.progress import node_progress, recorded_beats
from launcher.job.spec import JobSpec
from launcher.job.verdict import hung
from launcher.supervisor.watchdog import Watchdog, waits_in
from tests.unit.plans import local_plan
from trainer.distributed import DistEnv


def _beat(rank: int, t: float, phase: str = "step", slowest: float = 0.1, step: int = 7) -> Beat:
    return Beat(rank=rank, local_rank=0, pid=100 + rank, step=step, phase=phase, phase_since=0.0, time=t,
                slowest_step_s=slowest)  # fmt: skip


def test_the_automatic_step_budget_has_a_floor_and_follows_the_slowest_recent_step() -> None:
    spec = HangSpec()
    assert spec.budget(_beat(0, 0, slowest=0.5)) == FLOOR_S
    assert spec.budget(_beat(0, 0, slowest=60.0)) == STEP_FACTOR * 60.0
    assert spec.budget(_beat(0, 0, phase="startup")) == spec.startup_s
    assert (
        spec.budget(_beat(0, 0, phase="eval")) == spec.budget(_beat(0, 0, phase="checkpoint")) == spec.phase_s
    )
    assert HangSpec(timeout_s=5).budget(_beat(0, 0, slowest=60.0)) == 5


def test_a_stall_needs_every_rank_silent_past_its_budget() -> None:
    spec = HangSpec(timeout_s=10)
    now = 1000.0
    assert stalled(spec, [_beat(0, now - 11), _beat(1, now - 12)], expected=2, now=now) == Stall(
        step=7, silent_s=11.0, budget_s=10.0
    )
    assert stalled(spec, [_beat(0, now - 11), _beat(1, now - 9)], expected=2, now=now) is None  # 1 advances
    assert stalled(spec, [_beat(0, now - 11)], expected=2, now=now) is None  # rank 1 has not started
    assert stalled(spec, [_beat(0, now - 11), _beat(1, now - 11, phase="eval")], 2, now) is None  # eval
    assert stalled(HangSpec(timeout_s=0), [_beat(0, 0), _beat(1, 0)], expected=2, now=now) is None  # off


PY_SPY = """Process 1: python -m trainer.cli train
Python v3.11.7

Thread 1 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2950)
    wrapper (torch/distributed/c10d_logger.py:81)
    agree (trainer/step.py:70)
Thread 2 (idle): "Thread-1"
    barrier (torch/distributed/distributed_c10d.py:4000)
"""


def test_the_collective_is_read_from_the_main_threads_innermost_torch_distributed_frame() -> None:
    assert waits_in(PY_SPY) == "all_reduce"
    assert waits_in(PY_SPY.replace("all_reduce (", "my_reduce (")) is None  # the other thread's barrier
    ddp = 'Thread 1 (idle): "MainThread"\n    backward (torch/autograd/__init__.py:395)\n    step (a.py:1)\n'
    assert waits_in(ddp) == "backward (DDP's gradient all_reduce)"
    assert waits_in("no stack: the process is gone") is None
    native = (  # `py-spy dump --native` of a rank waiting for its peer's gradients (torch 2.13, CPU)
        'Thread 1506 (idle): "MainThread"\n    0x7fb7d90a3f16 (libc.so.6)\n'
        "    pthread_cond_wait (libc.so.6)\n"
        "    c10d::Reducer::finalize_backward (libtorch_cpu.so)\n"
        "    torch::autograd::Engine::thread_main (libtorch_cpu.so)\n"
        "    _engine_run_backward (torch/autograd/graph.py:979)\n"
    )
    assert waits_in(native) == "backward (DDP's gradient all_reduce)"
    spinning = 'Thread 9 (active+gil): "MainThread"\n    gloo::transport::tcp::Pair::recv (libtorch_cpu.so)\n'
    assert waits_in(spinning) == "a collective (gloo::transport::tcp::Pair::recv)"


def _rank(rank: int, host: str, state: str, waits: str | None, step: int = 1233) -> RankReport:
    stack = PY_SPY if waits else ""
    return RankReport(rank=rank, local_rank=0, pid=100 + rank, node=rank, host=host, step=step, phase="step",
                      state=state, waits_in=waits, stack=stack, python_frames=3)  # fmt: skip


def test_the_message_names_the_stopped_rank_against_those_that_wait(tmp_path: Path) -> None:
    ranks = [
        _rank(0, "gl-h1", "sleeping", "all_reduce", step=1234),
        _rank(1, "gl-h2", "stopped", None),
        _rank(2, "gl-h3", "sleeping", "all_reduce"),
        _rank(3, "gl-h4", "disk-sleep", None),
    ]
    message = hang_message(
        HangReport(silent_s=124.4, budget_s=120.0, step=1234, ranks=ranks), tmp_path / "hang"
    )
    assert message == (
        "hang: no progress for 124 s (budget 120 s) at step 1,234: rank 1 (node 1, gl-h2) is stopped "
        "(SIGSTOP?); rank 3 (node 3, gl-h4) is in uninterruptible sleep (state D: I/O, a driver); "
        f"ranks 0, 2 wait in all_reduce; stacks in {tmp_path / 'hang'}/"
    )
    # A retry avoids the suspects' nodes (SSH: a spare in place of gl-h2; SLURM: --exclude).
    outcome = hung(tmp_path, HangReport(silent_s=124.4, budget_s=120.0, step=1234, ranks=ranks))
    assert outcome.blamed_nodes() == [1, 3]


def test_a_rank_whose_stack_shows_no_python_frame_is_not_made_a_suspect(tmp_path: Path) -> None:
    spinning = _rank(0, "gl-h1", "running", None).model_copy(update={"python_frames": 0})
    busy = _rank(2, "gl-h3", "running", None)  # Python frames, none of them a collective
    report = HangReport(
        silent_s=31, budget_s=30, step=9, ranks=[spinning, _rank(1, "gl-h2", "stopped", None), busy]
    )
    message = hang_message(report, tmp_path)
    assert (
        spinning.suspect is None and "rank 0 (" not in message and "no frame readable for rank 0" in message
    )
    assert (
        "rank 1 (node 1, gl-h2) is stopped" in message
        and "rank 2 (node 2, gl-h3) is not in a collective" in message
    )


def test_a_rank_short_of_the_collective_the_others_wait_in_is_named_behind(tmp_path: Path) -> None:
    """Nothing readable in any stack (spinning in C++): the flight recorders tell. Ranks 0 and 2 wait
    in all_reduce #6, rank 1 finished #5 and never called #6; a side group's numbers are not compared."""

    def rank(r: int, seq: int, done: bool, pg: int = 0) -> RankReport:
        blind = _rank(r, f"gl-h{r + 1}", "running", None).model_copy(update={"python_frames": 0})
        last = Collective(pg=pg, seq=seq, op="gloo:all_reduce", done=done)
        return blind.model_copy(update={"collective": last})

    waiting = Collective(pg=0, seq=6, op="gloo:all_reduce", done=False).describe()
    ranks = [rank(0, 6, False), rank(1, 5, True), rank(2, 6, False), rank(3, 2, True, pg=1)]
    ranks = [r.model_copy(update={"waits_in": waiting}) if not r.collective.done else r for r in ranks]
    message = hang_message(HangReport(silent_s=31, budget_s=30, step=9, ranks=ranks), tmp_path)
    assert (
        "rank 1 (node 1, gl-h2) is behind: its last collective is #5, others are in gloo:all_reduce #6;"
        in message
    ), message
    assert "ranks 0, 2 wait in gloo:all_reduce #6" in message and "no frame readable for rank 3" in message


def test_each_nodes_newest_hang_report_is_read_back_from_the_record_and_merged(tmp_path: Path) -> None:
    node0 = HangReport(silent_s=31, budget_s=30, step=8, ranks=[_rank(0, "gl-h1", "sleeping", "all_reduce")])
    node1 = HangReport(silent_s=33, budget_s=30, step=7, ranks=[_rank(1, "gl-h2", "stopped", None)])
    older = node1.model_copy(update={"step": 2})
    for node, report, at in ((1, older, 100.0), (0, node0, 200.0), (1, node1, 201.0)):
        reports.append(tmp_path, reports.Hang(node=node, hang=report, time=at))
    with open(tmp_path / "reports" / "node-2.jsonl", "ab") as cut:  # a node killed in mid-write
        cut.write(reports.encode(reports.Hang(node=2, hang=node0, time=202.0))[:50])
    assert reports.hangs(tmp_path) == [node0, node1]
    assert reports.hangs(tmp_path, since=200.5) == [node1]  # an earlier attempt's are not this one's
    job = merge(reports.hangs(tmp_path))
    assert (job.silent_s, job.step, [r.rank for r in job.ranks]) == (33, 8, [0, 1])


def test_the_heartbeat_publishes_phases_and_throttles_steps(tmp_path: Path, monkeypatch) -> None:
    clock = iter(range(1000, 2000))
    monkeypatch.setattr("gptlaunch.heartbeat.time.time", lambda: float(next(clock)) / 10)  # 0.1 s a call
    served = []  # the flight recorder's server (tested against torch in test_flight_recorder)
    monkeypatch.setattr("gptlaunch.flight_recorder.start", lambda d, rank: served.append(rank) or "/fr.sock")
    beat = Heartbeat(DistEnv(rank=3, local_rank=1, world_size=4), tmp_path / "node-1")
    (startup,) = read_beats(tmp_path / "node-1")
    assert (startup.rank, startup.local_rank, startup.phase, startup.step) == (3, 1, "startup", 0)
    assert served == [3] and startup.debug_socket == "/fr.sock"
    beat.step_done(1, 0.25)  # leaving start-up is always published
    assert read_beats(tmp_path / "node-1")[0].phase == "step"
    beat.step_done(2, 2.0)  # within BEAT_INTERVAL_S of the last write: not yet
    assert read_beats(tmp_path / "node-1")[0].step == 1
    for step in range(3, 8):
        beat.step_done(step, 0.5)
    latest = read_beats(tmp_path / "node-1")[0]
    assert latest.step > 2 and latest.slowest_step_s == 2.0
    assert beat.enter("checkpoint") == "step"
    assert read_beats(tmp_path / "node-1")[0].phase == "checkpoint"
    beat.enter("step")
    assert read_beats(tmp_path / "node-1")[0].phase == "step"
    # For goodput: the seconds spent in each phase so far (a fake clock of 0.1 s a call), and the resume.
    beat.resumed(40)
    beat.flush()
    latest = read_beats(tmp_path / "node-1")[0]
    assert latest.start_step == 40 and set(latest.phase_s) == {"startup", "step", "checkpoint"}
    assert all(v > 0 for v in latest.phase_s.values()), latest.phase_s


def test_a_new_watchdog_forgets_an_earlier_runs_beats(tmp_path: Path) -> None:
    """A requeued or retried job: the last run's beats are old, and would be a hang at the first look."""
    write_beat(tmp_path, _beat(0, time.time() - 3600))
    watchdog = Watchdog(0, "h", tmp_path, nproc=1, spec=HangSpec(timeout_s=10))
    assert read_beats(tmp_path) == [] and watchdog.check() is None


def test_without_a_heartbeat_dir_nothing_is_written_and_bad_files_are_skipped(tmp_path: Path) -> None:
    Heartbeat(DistEnv(), None).step_done(1, 0.1)
    write_beat(tmp_path, _beat(0, 5.0))
    (tmp_path / "rank-1.json").write_text("{not json")
    assert read_beats(tmp_path) == [_beat(0, 5.0)]
    assert read_beats(tmp_path / "missing") == []


def test_a_negative_hang_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        HangSpec(timeout_s=-1)


def test_status_reads_each_nodes_progress_from_the_job_record(tmp_path: Path) -> None:
    spec = JobSpec.model_validate({"nnodes": 2})
    plan = local_plan(spec, tmp_path / "job", tmp_path)
    now = 1000.0
    for k in (0, 1):
        heartbeat_dir(tmp_path / "job", k).mkdir(parents=True)
    warning = "no space left on /run's file system: ...; not saved, training goes on"  # runtime.warn's
    fast = Beat(**{**_beat(0, now - 3, step=41).__dict__, "compute_s": 0.010, "warning": warning})
    write_beat(heartbeat_dir(tmp_path / "job", 0), fast)
    slow = Beat(**{**_beat(1, now - 200, step=40).__dict__, "compute_s": 0.019})
    write_beat(heartbeat_dir(tmp_path / "job", 1), slow)
    beats = recorded_beats(plan, tmp_path / "job")
    node0, node1 = node_progress(plan, HangSpec(timeout_s=60), beats, now)
    assert (node0.step, node0.heartbeat_age_s, node0.stalled_s, node0.stragglers) == (41, 3.0, None, {})
    assert (node1.step, node1.stalled_s) == (40, 200.0)
    assert node1.stragglers == {1: pytest.approx(1.9)}  # against the other ranks' median: 19 ms / 10 ms
    assert "NO PROGRESS for 200 s" in node1.describe() and "straggler: rank 1 at 1.9×" in node1.describe()
    assert node0.describe().endswith(f"\n    rank 0 warns: {warning}") and "warns" not in node1.describe()
