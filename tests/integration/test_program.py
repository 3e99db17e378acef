"""The user's own training script under the launcher, with real torchrun processes: the plain example
(``examples/ddp_plain.py``, which knows nothing of the launcher) trains on two local nodes and is
watched with no change (steps in its beats, a frozen rank's hang with the script's own frames), a
retry resumes it with ``--resume-args``; the API example runs unchanged under bare torchrun and
answers a cancel with a checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from gptlaunch.contract import read_beats, read_stop_marker
from launcher.job.record import JobRecord
from tests.integration.conftest import (
    frozen_until_ended,
    launcher,
    only_job_id,
    processes_of,
    run,
    wait_for_steps,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PLAIN, WITH_API = str(EXAMPLES / "ddp_plain.py"), str(EXAMPLES / "ddp_runtime.py")
TWO_NODES = ("--nodes", "2", "--gpus-per-node", "1")
HANG_TIMEOUT_S = 10.0


@pytest.fixture
def text(wikitext_valid: Path) -> list[str]:
    return ["--data", str(wikitext_valid)]


def _beat_dirs(job_dir: Path) -> list[Path]:
    return [job_dir / "heartbeat" / f"node-{k}" for k in (0, 1)]


def test_the_plain_script_trains_on_two_nodes_and_its_steps_are_watched(text, tmp_path: Path) -> None:
    jobs, out = tmp_path / "jobs", tmp_path / "out"
    done = launcher(jobs, "submit", *TWO_NODES, "--", PLAIN, *text, "--steps", "30", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 30/30" in done.stdout and (out / "ckpt.pt").is_file()
    job_dir = jobs / only_job_id(jobs)
    beats = [beat for d in _beat_dirs(job_dir) for beat in read_beats(d)]
    assert sorted((b.rank, b.step) for b in beats) == [(0, 30), (1, 30)]  # the optimizer's own steps
    assert all(b.debug_socket for b in beats)  # the flight recorder served


def test_a_frozen_rank_of_the_plain_script_is_a_hang_with_the_scripts_frames(text, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", *TWO_NODES, "--hang-timeout-s", str(HANG_TIMEOUT_S),
        "--", PLAIN, *text, "--steps", "1000000", "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_id = only_job_id(jobs)
    job_dir = jobs / job_id
    rank1 = next(b for b in wait_for_steps(_beat_dirs(job_dir), step=3) if b.rank == 1)
    status = frozen_until_ended(job_dir, rank1.pid, HANG_TIMEOUT_S + 90)
    assert status is not None and status.state == "failed", status
    assert status.message.startswith("hang: no progress for "), status.message
    assert "rank 1 (node " in status.message and "is stopped (SIGSTOP?)" in status.message
    [healthy_file] = (job_dir / "hang").glob("node*-rank0.txt")  # c10d picks which node holds rank 0
    healthy = healthy_file.read_text()
    assert "(ddp_plain.py:" in healthy, healthy[:3000]  # the script's own frames, wherever it waits
    assert processes_of(job_id) == []


def test_a_retry_resumes_the_plain_script_with_its_resume_args(text, tmp_path: Path) -> None:
    jobs, out = tmp_path / "jobs", tmp_path / "out"
    submit = launcher(
        jobs, "submit", "--detach", *TWO_NODES, "--retries", "1", "--retry-backoff-s", "0",
        "--resume-args=--init-from resume", "--", PLAIN, *text, "--steps", "1000",
        "--checkpoint-every", "20", "--out", str(out),
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_dir = jobs / only_job_id(jobs)
    beats = wait_for_steps(_beat_dirs(job_dir), step=25)
    os.kill(next(b for b in beats if b.rank == 1).pid, signal.SIGKILL)
    steps = _second_attempts_steps(job_dir, re.compile(r"step (\d+)/1000 loss"))
    resumed = wait_for_steps(_beat_dirs(job_dir), step=steps[0])  # the second attempt's beats
    launcher(jobs, "cancel", job_dir.name, check=True)
    # The second attempt loaded the checkpoint of step 20 or later: its steps go on from there (the
    # script prints every 10th), and so does its heartbeat, from AdamW's own step count.
    assert steps[0] > 20, steps
    assert all(b.start_step >= 20 and b.step >= steps[0] for b in resumed), resumed
    argv = json.loads((job_dir / "plan.json").read_text())["nodes"][0]["env"]
    assert json.loads(argv["GPTLAUNCH_RESUME_ARGS"]) == ["--init-from", "resume"]


def test_a_retry_of_the_api_script_resumes_from_the_snapshot_in_memory(text, tmp_path: Path) -> None:
    """No checkpoint on disk (one every 1000 steps), a snapshot in each host's memory every 10: rank 1
    SIGKILLed past step 25, the second attempt goes on from a host's snapshot of step 20 or later."""
    jobs = tmp_path / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", *TWO_NODES, "--retries", "1", "--retry-backoff-s", "0",
        "--", WITH_API, *text, "--steps", "1000000", "--checkpoint-every", "1000",
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_dir = jobs / only_job_id(jobs)
    beats = wait_for_steps(_beat_dirs(job_dir), step=25)
    os.kill(next(b for b in beats if b.rank == 1).pid, signal.SIGKILL)
    steps = _second_attempts_steps(job_dir, re.compile(r"step (\d+)/1000000 loss"))
    launcher(jobs, "cancel", job_dir.name, check=True)
    logs = "".join(log.read_text() for log in job_dir.glob("node-*.log"))
    resumed = re.search(r"resumed from the snapshot in \S+ memory at step (\d+)", logs)
    assert resumed is not None and int(resumed[1]) >= 20 and steps[0] > int(resumed[1]), logs[-3000:]


def _second_attempts_steps(job_dir: Path, printed: re.Pattern[str]) -> list[int]:
    """The steps rank 0 printed in the job's second attempt, once it printed one (at most 180 s)."""
    record, deadline = JobRecord(job_dir), time.monotonic() + 180
    while not (record.status().attempt == 2 and (steps := _printed_steps(job_dir, printed))):
        assert time.monotonic() < deadline, "the second attempt printed no step in 180 s"
        time.sleep(0.2)
    return steps


def _printed_steps(job_dir: Path, printed: re.Pattern[str]) -> list[int]:
    """The steps rank 0 printed in this attempt's node logs (an ended attempt's are archived)."""
    text = "".join(log.read_text() for log in job_dir.glob("node-*.log"))
    return [int(m) for m in printed.findall(text)]


def test_the_api_script_runs_unchanged_under_bare_torchrun(text, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPTLAUNCH_")} | {"OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", WITH_API]
    done = run([*argv, *text, "--steps", "20", "--out", str(tmp_path / "out")], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 20/20" in done.stdout and (tmp_path / "out" / "ckpt.pt").is_file()


def test_the_api_script_checkpoints_and_exits_75_on_a_cancel(text, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    submit = launcher(jobs, "submit", "--detach", *TWO_NODES, "--", WITH_API, *text, "--steps", "1000000")
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_dir = jobs / only_job_id(jobs)
    wait_for_steps(_beat_dirs(job_dir), step=3)
    cancelled = launcher(jobs, "cancel", job_dir.name)
    assert cancelled.returncode == 0 and "checkpointed" in cancelled.stdout, cancelled.stderr
    status = json.loads((job_dir / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("checkpointed", 75)
    marker = read_stop_marker(job_dir / "run", since=0)  # where runtime.checkpoint_dir() pointed
    assert marker is not None and marker.step >= 3 and (job_dir / "run" / "ckpt.pt").is_file()
    assert processes_of(job_dir.name) == []
