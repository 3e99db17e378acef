"""Fail fast and leave nothing; stop on request with a checkpoint; hostile strings never execute."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptlaunch.contract import EXIT_REFUSED, read_beats
from launcher.job.logs import wait_terminal
from launcher.job.record import JobRecord, JobStatus
from launcher.job.spec import JobSpec
from launcher.schedulers.local.scheduler import LocalFacts, LocalScheduler
from tests.integration.conftest import FAST, launcher, losses, only_job_id, processes_of, wait_for_steps

TWO_NODES = ["submit", "--nodes", "2", "--gpus-per-node", "1"]


def test_a_failing_rank_stops_the_whole_job_fast_and_is_named(prepared_data, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    t0 = time.monotonic()
    proc = launcher(
        jobs, *TWO_NODES, "--", *prepared_data, *FAST, "--max-steps", "200", env={"GPTLAUNCH_FAULT": "1:3"}
    )
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert took < 30 + 10, f"took {took:.1f} s"  # + process start-up and data loading
    assert "rank 1" in proc.stderr and "injected fault on rank 1 at step 3" in proc.stderr
    job_id = only_job_id(jobs)
    assert processes_of(job_id) == []
    status = json.loads((jobs / job_id / "status.json").read_text())
    assert status["state"] == "failed" and status["failure"]["rank"] == 1


def test_a_rank_killed_by_sigkill_is_the_cause_not_the_peer_that_saw_it_go(
    prepared_data, tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", "--nodes", "2", "--", *prepared_data, *FAST, "--max-steps", "100000"
    )
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_dir = jobs / only_job_id(jobs)
    beat_dirs = [job_dir / "heartbeat" / f"node-{k}" for k in (0, 1)]
    beats = wait_for_steps(beat_dirs, step=2)
    # c10d hands out ranks in the order the nodes join: rank 1 may be on either node.
    node = next(k for k, d in enumerate(beat_dirs) if any(b.rank == 1 for b in read_beats(d)))
    os.kill(next(b.pid for b in beats if b.rank == 1), signal.SIGKILL)
    final = wait_terminal(LocalScheduler().state, JobRecord(job_dir), 120, poll_s=0.1)
    assert final is not None and final.state == "failed" and final.failure is not None, final
    assert (final.failure.node_rank, final.failure.rank) == (node, 1), final.failure
    assert "rank 1 was killed by SIGKILL" in final.message, final.message
    print(f"\n{final.message}")


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if (run_dir / "metrics.jsonl").is_file() and max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.mark.parametrize("how", ["ctrl-c", "launcher cancel", "SIGTERM to one node's agent"])
def test_stop_request_checkpoints_every_rank_and_a_resubmit_resumes(
    how: str, prepared_data, tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    args = [
        *TWO_NODES,
        "--",
        *prepared_data,
        *FAST,
        "--run-dir",
        str(run_dir),
        "--checkpoint-interval",
        "1000",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), *args, "--max-steps", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_step(run_dir, 3, proc)
        job_id = only_job_id(jobs)
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        elif how == "launcher cancel":
            launcher(jobs, "cancel", job_id, check=True)
        else:  # e.g. a machine shutting down: one node's torchrun agent gets SIGTERM, not the launcher
            node_pids = json.loads((jobs / job_id / "handle.json").read_text())["node_pids"]
            os.kill(node_pids[1], signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-3000:]
    assert "checkpointed" in err
    (ckpt,) = run_dir.glob("ckpt-*.pt")
    stopped_at = int(ckpt.stem.split("-")[1])
    assert stopped_at >= 3 and max(losses(run_dir)) == stopped_at
    assert processes_of(job_id) == []
    assert json.loads((jobs / job_id / "status.json").read_text())["state"] == "checkpointed"

    again = launcher(jobs, *args, "--max-steps", str(stopped_at + 2))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at step {stopped_at}" in again.stdout
    assert sorted(losses(run_dir)) == list(range(1, stopped_at + 3))


def test_hostile_strings_in_paths_env_and_arguments_are_passed_verbatim(
    prepared_data, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    run_dir = tmp_path / f"run a'; touch {marker}; $(touch {marker}) `touch {marker}`"
    jobs = tmp_path / "jobs"
    proc = launcher(
        jobs,
        *TWO_NODES,
        "--env",
        f"HOSTILE=$(touch {marker})",
        "--",
        *prepared_data,
        *FAST,
        "--max-steps",
        "2",
        "--run-dir",
        str(run_dir),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "ckpt-00000002.pt").is_file()  # the literal directory name was used
    assert not marker.exists()
    plan = json.loads((jobs / only_job_id(jobs) / "plan.json").read_text())
    assert plan["nodes"][0]["env"]["HOSTILE"] == f"$(touch {marker})"


def test_a_parity_refusal_in_a_node_is_the_jobs_exit_code_and_message(tmp_path: Path) -> None:
    # the compose scheduler's node entry under the real supervisor: node 1 reports another image
    # digest, so the nodes refuse before the command runs, and the job ends with exit 3 and the diff
    spec, job_dir = JobSpec(nnodes=2), tmp_path / "job-1"
    facts = {"workdir": str(tmp_path), "rdzv_host": "127.0.0.1", "rdzv_port": 29556, "omp_num_threads": 1}
    plan = LocalScheduler().render(
        spec, LocalFacts(**facts, gpus=[], agent_python=sys.executable), "job-1", job_dir
    )
    entry = [
        sys.executable,
        "-m",
        "launcher.schedulers.compose.node",
        "--job-dir",
        str(job_dir),
        "--nodes",
        "2",
    ]
    nodes = [
        node.model_copy(
            update={
                "argv": [*entry, "--node", str(k), "--", sys.executable, "-c", "print('trained')"],
                "env": node.env | {"GPTLAUNCH_IMAGE_DIGEST": f"sha256:{'ab'[k] * 64}"},
            }
        )
        for k, node in enumerate(plan.nodes)
    ]
    plan = plan.model_copy(update={"nodes": nodes})
    record = JobRecord.create(job_dir, spec, plan, JobStatus(created_at=time.time()))
    handle = LocalScheduler().submit(plan, record, detach=False)
    final = wait_terminal(LocalScheduler().state, record, 180, poll_s=0.1)
    os.waitpid(handle.supervisor.pid, 0)
    assert final is not None and final.state == "failed" and final.job_exit_code == EXIT_REFUSED
    assert final.message is not None and "image_digest" in final.message and "b" * 64 in final.message
    assert "trained" not in (job_dir / "node-0.log").read_text() + (job_dir / "node-1.log").read_text()
