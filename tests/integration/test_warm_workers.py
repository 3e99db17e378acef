"""Warm workers (``--warm-workers``) on the local scheduler, with real faults: once the job's zygote has
imported torch, a retry's ranks are forked from it; a rank killed (SIGKILL) or frozen (SIGSTOP, a hang)
is seen and retried as a cold rank's would be, the job ends with exactly the losses of an
uninterrupted run, and nothing of it (the zygote included) outlives it."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import psutil

from launcher.job.follow import wait_terminal
from launcher.job.record import Attempt, JobRecord
from launcher.schedulers.local.scheduler import LocalScheduler
from launcher.schedulers.local.warm import LOG, zygote_socket
from tests.integration.conftest import losses, processes_of, wait_for, wait_for_steps
from tests.integration.test_retries import _submit  # the same local 2-node job, 30 steps


def _zygote(job_dir: Path) -> psutil.Process:
    ready = re.search(r"ready on \S+ \(pid (\d+)\)", (job_dir / LOG).read_text())
    assert ready is not None
    return psutil.Process(int(ready[1]))


def test_a_retry_forks_its_ranks_from_the_warm_zygote_and_faults_are_retried_as_usual(
    prepared_data, tmp_path: Path
) -> None:
    reference = tmp_path / "reference"
    ref = _submit(tmp_path / "ref-jobs", reference, prepared_data)
    assert wait_terminal(LocalScheduler(), JobRecord(ref), 300, poll_s=0.2).state == "succeeded"

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
    final = wait_terminal(LocalScheduler(), JobRecord(job_dir), 300, poll_s=0.2)
    assert final is not None and final.state == "succeeded", final
    first, second = (
        Attempt.model_validate_json((job_dir / "attempts" / k / "attempt.json").read_text()) for k in "12"
    )
    assert "rank 1 was killed by SIGKILL" in first.cause, first
    assert second.cause.startswith("hang: no progress") and "is stopped (SIGSTOP?)" in second.cause, second
    assert sorted((job_dir / "attempts" / "2" / "hang").iterdir())  # the forked ranks' stacks
    assert losses(run_dir) == losses(reference)  # bit for bit
    assert processes_of(job_dir.name) == [] and not zygote.is_running()
    assert not zygote_socket(job_dir.name).parent.exists()
