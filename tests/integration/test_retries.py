"""Job-level retries on the local scheduler with real faults: a rank killed by SIGKILL and a frozen
rank (a hang) are retried from the last checkpoint and the job succeeds with exactly the losses of an
uninterrupted run (with warm workers: once the job's zygote has imported torch, a retry's ranks are
forked from it, and nothing of it outlives the job); an error that repeats at the same step stops
after two attempts; a failure after new steps is retried at once, one that repeats with no new step
waits a backoff, and a cancel during it ends the job and nothing starts afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from gptlaunch.contract import Beat, job_snapshots, read_beats
from launcher.job.logs import wait_terminal
from launcher.job.record import Attempt, JobRecord
from launcher.schedulers.local.scheduler import LocalScheduler
from launcher.schedulers.local.warm import LOG, zygote_socket
from tests.integration.conftest import (
    FAST,
    TINY,
    launcher,
    losses,
    metrics,
    only_job_id,
    plain_project,
    processes_of,
    wait_for,
    wait_for_steps,
)

STEPS = 30
CKPT = ["--checkpoint-interval", "10", "--eval-interval", "100000"]


def _submit(
    jobs: Path,
    run_dir: Path,
    data: list[str],
    *flags: str,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> Path:
    """A detached local 2-node job; ``flags`` are the launcher's, ``extra`` the trainer's (last)."""
    # TINY: a kill must land in a step's compute, not its collectives, for a survivor to keep its step
    argv = ["submit", "--detach", "--nodes", "2", *flags, "--", *data, *FAST, *TINY, *CKPT, *(extra or [])]
    proc = launcher(jobs, *argv, "--max-steps", str(STEPS), "--run-dir", str(run_dir), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return jobs / only_job_id(jobs)


@pytest.fixture(scope="module")
def reference(prepared_data: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of the job never interrupted (once for the module), step -> loss."""
    tmp = tmp_path_factory.mktemp("reference")
    ref = _submit(tmp / "jobs", tmp / "run", prepared_data)
    assert wait_terminal(LocalScheduler().state, JobRecord(ref), 300, poll_s=0.2).state == "succeeded"
    return losses(tmp / "run")


def _zygote(job_dir: Path) -> psutil.Process:
    ready = re.search(r"ready on \S+ \(pid (\d+)\)", (job_dir / LOG).read_text())
    assert ready is not None
    return psutil.Process(int(ready[1]))


def _status(job_dir: Path) -> dict:
    return dict(json.loads((job_dir / "status.json").read_text()))


def test_a_killed_rank_and_a_hang_are_retried_from_warm_workers_and_the_losses_match_an_uninterrupted_run(
    prepared_data: list[str], reference: dict[int, float], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    job_dir = _submit(tmp_path / "jobs", run_dir, prepared_data, "--warm-workers", "--retries", "2",
                      "--retry-backoff-s", "1", "--hang-timeout-s", "5")  # fmt: skip
    beat_dirs = [job_dir / "heartbeat" / f"node-{k}" for k in (0, 1)]
    wait_for(lambda: "ready" in (job_dir / LOG).read_text(), 120, "the zygote to import torch")
    zygote = _zygote(job_dir)
    beats = wait_for_steps(beat_dirs, step=12)
    os.kill(next(b.pid for b in beats if b.rank == 1), signal.SIGKILL)  # after the checkpoint of step 10
    wait_for(lambda: (job_dir / "attempts" / "1").is_dir(), 120, "attempt 1 to end")
    beats = wait_for_steps(beat_dirs, step=14)
    # Attempt 2's ranks are the zygote's children, and their torch is the one it imported.
    ranks = [psutil.Process(b.pid) for b in beats]
    assert {p.ppid() for p in ranks} == {zygote.pid}, beats
    assert all(" ".join(p.cmdline()).split()[1:3] == ["-m", "trainer.cli"] for p in ranks)  # as ps shows
    os.kill(next(b.pid for b in beats if b.rank == 1), signal.SIGSTOP)  # a hang of a forked rank
    final = wait_terminal(LocalScheduler().state, JobRecord(job_dir), 300, poll_s=0.2)
    assert final is not None and final.state == "succeeded", final
    first, second = (
        Attempt.model_validate_json((job_dir / "attempts" / k / "attempt.json").read_text()) for k in "12"
    )
    assert "rank 1 was killed by SIGKILL" in first.cause and first.step is not None and first.step >= 12, (
        first
    )
    assert second.cause.startswith("hang: no progress") and "is stopped (SIGSTOP?)" in second.cause, second
    assert (final.attempt, [a.number for a in final.attempts]) == (3, [1, 2])
    assert sorted((job_dir / "attempts" / "2" / "hang").iterdir())  # each attempt keeps its own stacks
    logs = (job_dir / "node-0.log").read_text() + (job_dir / "node-1.log").read_text()
    assert "resumed from" in logs  # attempt 3 from the checkpoint (rank 0's line, on either node)
    # Every step logged once, and the same losses bit for bit as the run that was never interrupted.
    steps = [m["step"] for m in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
             if "tokens_per_s" in m]  # fmt: skip
    assert steps == list(range(1, STEPS + 1))
    assert losses(run_dir) == reference
    text = launcher(tmp_path / "jobs", "status", job_dir.name, check=True).stdout
    assert "attempt 3 of 3" in text and "attempt 1 at step" in text and "attempt 2 at step" in text, text
    # Goodput: the failures cost time (the hang alone its --hang-timeout-s), and the parts add up.
    goodput = json.loads(launcher(tmp_path / "jobs", "status", "--json", job_dir.name, check=True).stdout)[
        "goodput"
    ]
    # The kill's retry redid no step when rank 0 kept the step it held, else those since step 10's
    # checkpoint (killed past step 12).
    kept = "kept step" in (job_dir / "attempts" / "1" / "node-0.log").read_text()
    redone = goodput["steps_redone"][0]
    assert redone == 0 if kept else 2 <= redone <= 10, (kept, goodput)
    assert goodput["failures"] == 2 and goodput["lost_s"] > 1 and 0 < goodput["ratio"] < 1, goodput
    parts = ("training_s", "startup_s", "lost_s", "checkpoint_s", "eval_s", "other_s")
    assert abs(sum(goodput[k] for k in parts) - goodput["wall_s"]) < 1e-6 * goodput["wall_s"], goodput
    assert "lost" in text and "to 2 failures" in text, text
    assert processes_of(job_dir.name) == [] and not zygote.is_running()
    assert not zygote_socket(job_dir.name).parent.exists()


def test_a_killed_rank_resumes_from_the_snapshot_in_memory_when_no_checkpoint_is_on_disk(
    prepared_data: list[str], reference: dict[int, float], tmp_path: Path
) -> None:
    """No checkpoint before step 100, a snapshot in host memory every 10 steps: rank 1 SIGKILLed at the
    top of step 17 (a drill, so that rank 0 is sure to wait for it in that step's first collective,
    before any update). Rank 0, the survivor, keeps the state of step 17 on its way out, and the next
    attempt goes on from it, redoing no step; every later loss is the reference's."""
    run_dir = tmp_path / "run"
    job_dir = _submit(
        tmp_path / "jobs", run_dir, prepared_data, "--retries", "1",
        env={"GPTLAUNCH_FAULT": "1:17:SIGKILL"}, extra=["--checkpoint-interval", "100"],
    )  # fmt: skip
    snapshots = job_snapshots(job_dir.name)
    final = wait_terminal(LocalScheduler().state, JobRecord(job_dir), 300, poll_s=0.2)
    assert final is not None and final.state == "succeeded", final
    first = final.attempts[0]
    assert first.step == 17 and first.exit_code != 0, first
    logs = (job_dir / "node-0.log").read_text() + (job_dir / "node-1.log").read_text()
    assert re.search(r"resumed from the snapshot in \S+ memory at step 17\b", logs), logs[-3000:]
    kept = (job_dir / "attempts" / "1" / "node-0.log").read_text()
    assert "kept step 17's state in this host's memory for a retry" in kept, kept[-3000:]
    # On disk only the last step's checkpoint (two are kept): there was none to resume from.
    assert [p.name for p in run_dir.glob("ckpt-*.pt")] == [f"ckpt-{STEPS:08d}.pt"]
    steps = [m["step"] for m in metrics(run_dir) if "tokens_per_s" in m]
    assert steps == list(range(1, STEPS + 1))
    assert losses(run_dir) == reference  # bit for bit
    assert not snapshots.exists()  # the job ended: its snapshots are gone from memory


def test_an_error_at_the_same_step_twice_is_not_retried_again(prepared_data, tmp_path: Path) -> None:
    job_dir = _submit(tmp_path / "jobs", tmp_path / "run", prepared_data, "--retries", "3",
                      "--retry-backoff-s", "0", env={"GPTLAUNCH_FAULT": "1:3"})  # fmt: skip
    final = wait_terminal(LocalScheduler().state, JobRecord(job_dir), 300, poll_s=0.2)
    assert final is not None and final.state == "failed" and final.exit_code == 1, final
    assert "injected fault on rank 1 at step 3" in final.message, final.message
    assert "attempt 2 of 4; not retried: the same error at step" in final.message, final.message
    assert [a.number for a in final.attempts] == [1] and not (job_dir / "attempts" / "2").exists()


def test_a_nan_and_a_scripts_usage_error_are_not_retried_and_say_why(
    prepared_data, wikitext_valid: Path, tmp_path: Path
) -> None:
    """Program faults, which no node would change, end after one attempt with ``--retries 2``: a real
    divergence (the trainer's non-finite loss, told by its exception's type) and a user's script that
    refuses its arguments (argparse's exit 2, which becomes the job's)."""
    jobs, project = tmp_path / "jobs", plain_project(tmp_path, wikitext_valid)
    diverge = ["--lr", "1e3", "--warmup-steps", "0", "--grad-clip", "0", "--max-steps", "30"]
    nan = launcher(jobs, "submit", "--nodes", "2", "--retries", "2", "--", *prepared_data, *FAST, *diverge)
    assert nan.returncode == 1, nan.stderr[-3000:]
    said = nan.stderr.splitlines()[-1]
    assert "TrainingError: loss is " in said and "not retried: a program fault (a non-finite loss" in said
    usage = launcher(
        jobs, "submit", "--nodes", "2", "--retries", "2", "--workdir", str(project), "--",
        "ddp_plain.py", "--data", "input.txt", "--no-such-flag",
    )  # fmt: skip
    assert usage.returncode == 2, usage.stderr[-3000:]
    said = usage.stderr.splitlines()[-1]
    assert "exited with code 2 (invalid input" in said, said
    assert "(attempt 1 of 3; not retried: invalid input)" in said, said
    for job_id in (nan.stdout.splitlines()[0], usage.stdout.splitlines()[0]):
        assert not (jobs / job_id / "attempts").exists()  # no attempt was archived for a retry


def _rank1_beat(heartbeats: list[Path]) -> Beat | None:
    return next((b for d in heartbeats for b in read_beats(d) if b.rank == 1), None)


def _ended(job_dir: Path, k: int) -> Attempt:
    """Attempt ``k`` once archived (``attempt.json`` is written last, after its heartbeats moved)."""
    path = job_dir / "attempts" / str(k) / "attempt.json"
    wait_for(path.is_file, 120, f"attempt {k} to end")
    return Attempt.model_validate_json(path.read_text())


def test_a_failure_after_new_steps_starts_at_once_and_a_cancel_during_a_repeats_backoff_ends_the_job(
    prepared_data, tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs"
    job_dir = _submit(jobs, tmp_path / "run", prepared_data, "--retries", "3", "--retry-backoff-s", "600")
    heartbeats = [job_dir / "heartbeat" / f"node-{k}" for k in (0, 1)]
    beats = wait_for_steps(heartbeats, step=2)
    os.kill(next(b.pid for b in beats if b.rank == 1), signal.SIGKILL)
    first = _ended(job_dir, 1)
    assert first.step is not None and first.cleaned_at is not None
    beats = wait_for_steps(heartbeats, step=first.step + 1)  # attempt 2, past every step of attempt 1
    os.kill(next(b.pid for b in beats if b.rank == 1), signal.SIGKILL)
    second = _ended(job_dir, 2)
    wait_for(lambda: _rank1_beat(heartbeats) is not None, 120, "attempt 3's rank 1")
    beat = _rank1_beat(heartbeats)
    assert beat is not None
    os.kill(beat.pid, signal.SIGKILL)  # as it starts: a failure with no step past attempt 2's, a repeat
    third = _ended(job_dir, 3)
    # Both failures after new steps were retried at once (not 600 s later); the repeat waits.
    assert second.started_at - first.cleaned_at < 60, (first, second)
    assert second.step is not None and second.cleaned_at is not None and second.step > first.step
    assert third.started_at - second.cleaned_at < 60 and (third.step or 0) <= second.step, (second, third)
    wait_for(lambda: "attempt 4 of 4 starts in 600 s" in _status(job_dir)["message"], 120, "the backoff")
    cancel = launcher(jobs, "cancel", job_dir.name)
    assert cancel.returncode == 0, cancel.stderr
    status = _status(job_dir)
    assert (
        status["state"] == "cancelled" and "cancelled before attempt 4 of 4 started" in status["message"]
    ), status
    assert processes_of(job_dir.name) == [] and not (job_dir / "node-0.log").exists()  # no attempt 4
