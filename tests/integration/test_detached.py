"""Jobs that outlive the terminal: detached jobs followed from other processes, and no process of a job
left behind when whatever supervises it is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.conftest import FAST, launcher, losses, processes_of

TWO_NODES = ["submit", "--nodes", "2", "--gpus-per-node", "1"]
NO_ORPHANS_WITHIN_S = 60.0


def _launcher_cmd(jobs: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), *args]


def _detach(jobs: Path, run_dir: Path, prepared_data: list[str], steps: int) -> str:
    args = [*TWO_NODES, "--detach", "--", *prepared_data, *FAST, "--run-dir", str(run_dir)]
    argv = _launcher_cmd(jobs, *args, "--max-steps", str(steps), "--checkpoint-interval", "1000")
    # With stdin closed, as from a cron job or `<&-`: the supervisor must not take fd 0 for a pipe.
    proc = subprocess.run(
        ["bash", "-c", 'exec "$@" <&-', "-", *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    assert (jobs / job_id / "plan.json").is_file(), proc.stdout
    return job_id


def _wait_for_step(run_dir: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").is_file() and max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _state(jobs: Path, job_id: str) -> str:
    out = launcher(jobs, "status", "--json", job_id, check=True)
    return str(json.loads(out.stdout)["state"])


def _no_process_left(job_id: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while processes_of(job_id):
        assert time.monotonic() < deadline, [p.cmdline() for p in processes_of(job_id)]
        time.sleep(0.5)


def test_logs_follow_started_right_after_a_detached_submit_streams_to_the_end(
    prepared_data, tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    job_id = _detach(jobs, run_dir, prepared_data, steps=3)
    follow = launcher(jobs, "logs", "--follow", job_id, timeout=300)
    # It returned because the job ended, not at once: the end was recorded before it returned.
    assert json.loads((jobs / job_id / "status.json").read_text())["state"] == "succeeded"
    assert follow.returncode == 0 and "step 3/3" in follow.stdout
    assert {line.split(" | ")[0] for line in follow.stdout.splitlines()} == {"node0", "node1"}
    waited = launcher(jobs, "wait", job_id, timeout=60)
    assert waited.returncode == 0 and "succeeded" in waited.stderr


def test_a_detached_job_is_watched_waited_for_and_cancelled_from_other_processes(
    prepared_data, tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    job_id = _detach(jobs, run_dir, prepared_data, steps=1000)
    follow = subprocess.Popen(_launcher_cmd(jobs, "logs", "-f", job_id), stdout=subprocess.PIPE, text=True)
    waiter = subprocess.Popen(_launcher_cmd(jobs, "wait", job_id), stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run_dir, 2)
        assert _state(jobs, job_id) == "running"
        assert follow.poll() is None and waiter.poll() is None
        # From another process, importing no torch (the supervisor does the work).
        cancel = (
            "import sys; from launcher.cli.main import main; "
            f"code = main(['--jobs-root', {str(jobs)!r}, 'cancel', {job_id!r}]); "
            "assert 'torch' not in sys.modules; sys.exit(code)"
        )
        cancelled = subprocess.run(
            [sys.executable, "-c", cancel], capture_output=True, text=True, timeout=120
        )
        assert cancelled.returncode == 0 and "checkpointed" in cancelled.stdout, cancelled.stderr
        _, wait_err = waiter.communicate(timeout=60)
        follow_out, _ = follow.communicate(timeout=60)
    finally:
        follow.kill()
        waiter.kill()
    assert waiter.returncode == 75, wait_err
    assert follow.returncode == 0 and "stop signal: checkpoint saved" in follow_out
    assert _state(jobs, job_id) == "checkpointed"
    assert list(run_dir.glob("ckpt-*.pt")) and processes_of(job_id) == []


def test_sigkill_of_the_supervisor_stops_every_process_and_the_ranks_checkpoint(
    prepared_data, tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    job_id = _detach(jobs, run_dir, prepared_data, steps=1000)
    _wait_for_step(run_dir, 2)
    supervisor = json.loads((jobs / job_id / "handle.json").read_text())["supervisor"]["pid"]
    os.kill(supervisor, signal.SIGKILL)
    _no_process_left(job_id, NO_ORPHANS_WITHIN_S)
    assert _state(jobs, job_id) == "checkpointed"
    assert list(run_dir.glob("ckpt-*.pt"))
    waited = launcher(jobs, "wait", job_id, timeout=60)
    assert waited.returncode == 75


def test_sigkill_of_an_attached_submit_stops_every_process_and_the_ranks_checkpoint(
    prepared_data, tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    args = [*TWO_NODES, "--", *prepared_data, *FAST, "--run-dir", str(run_dir), "--max-steps", "1000"]
    submit = subprocess.Popen(
        _launcher_cmd(jobs, *args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_for_step(run_dir, 2)
        (job_id,) = [p.name for p in jobs.iterdir()]
        submit.kill()
        submit.wait(timeout=30)
        _no_process_left(job_id, NO_ORPHANS_WITHIN_S)
    finally:
        submit.kill()
    assert _state(jobs, job_id) == "checkpointed"


STARTS_NODE_0_THEN_FAILS_NODE_1 = """
import sys, time
from pathlib import Path
from launcher.job.record import JobRecord, JobStatus
from launcher.job.plan import NodePlan, Plan
from launcher.schedulers.local.scheduler import LocalScheduler
from launcher.job.spec import JobSpec

job_dir, job_id = Path(sys.argv[1]), sys.argv[2]
env = {"GPTLAUNCH_JOB_ID": job_id}
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
# Node 0 ignores SIGTERM (and so the parent-death signal): only the supervisor's cleanup can stop it.
ignore_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
stubborn = [sys.executable, "-c", ignore_term]
nodes = [
    NodePlan(node_rank=0, host="localhost", argv=stubborn, env=env, cwd="/", log="node-0.log"),
    NodePlan(node_rank=1, host="localhost", argv=sleeper, env=env, cwd="/no/such/dir", log="node-1.log"),
]
plan = Plan(job_id=job_id, scheduler="local", nnodes=2, nproc_per_node=1, rdzv_endpoint="127.0.0.1:1",
            run_dir=str(job_dir / "run"), nodes=nodes)
record = JobRecord.create(job_dir, JobSpec(nnodes=2), plan, JobStatus(created_at=time.time()))
handle = LocalScheduler().submit(plan, record, detach=False)
print(handle.model_dump_json())
"""


def test_a_node_that_cannot_start_stops_the_nodes_already_started(tmp_path: Path) -> None:
    job_id = f"startfail-{os.getpid()}"
    out = subprocess.run(
        [sys.executable, "-c", STARTS_NODE_0_THEN_FAILS_NODE_1, str(tmp_path / job_id), job_id],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    status = json.loads((tmp_path / job_id / "status.json").read_text())
    assert status["state"] == "failed" and "node 1 could not start" in status["message"]
    assert status["ended_at"] is not None
    assert processes_of(job_id) == [], "the cleanup must have killed node 0 before recording the end"


def test_the_controller_runs_a_two_node_job_in_the_foreground_as_a_program(
    prepared_data, tmp_path: Path
) -> None:
    """`launcher supervise --job-dir DIR`, run by hand on a job record nothing started: every attempt
    in the foreground, the end recorded, the job's exit code; `launcher submit` starts the same."""
    from launcher.job.record import JobRecord, JobStatus
    from launcher.job.spec import JobSpec
    from launcher.schedulers.local.scheduler import LocalScheduler

    job_dir, run_dir = tmp_path / "jobs" / "by-hand", tmp_path / "run"
    trainer = [*prepared_data, *FAST, "--run-dir", str(run_dir), "--max-steps", "3"]
    spec = JobSpec.model_validate({"nnodes": 2, "trainer_args": trainer})
    scheduler = LocalScheduler()
    plan = scheduler.render(spec, scheduler.resolve(spec), "by-hand", job_dir)
    JobRecord.create(job_dir, spec, plan, JobStatus(created_at=time.time()))
    argv = [sys.executable, "-m", "launcher.cli.main", "supervise", "--job-dir", str(job_dir)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as supervise:
        output, _ = supervise.communicate(timeout=300)
    status = json.loads((job_dir / "status.json").read_text())
    assert supervise.returncode == 0 and status["state"] == "succeeded", (output, status)
    handle = json.loads((job_dir / "handle.json").read_text())
    assert handle["supervisor"]["pid"] == supervise.pid  # this process ran the job, in the foreground
    assert "step 3/3" in (job_dir / "node-0.log").read_text()
    assert "rank 1/2" in (job_dir / "node-1.log").read_text()
    assert max(losses(run_dir)) == 3 and processes_of("by-hand") == []
