"""The hang watchdog against a real frozen rank: a 2-node local job whose rank 1 is stopped with
SIGSTOP from outside the trainer ends as a hang naming rank 1, with every rank's stack, and leaves
nothing behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from launcher.job.follow import wait_terminal
from launcher.job.record import JobRecord
from launcher.schedulers.local.scheduler import LocalScheduler
from tests.integration.conftest import FAST, launcher, only_job_id, processes_of
from trainer.contract import Beat, read_beats

HANG_TIMEOUT_S = 10.0


def _wait_for_steps(beat_dirs: list[Path], step: int, timeout_s: float = 180) -> list[Beat]:
    """Every rank's beat once each is past ``step`` in the step phase (polls the real files)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = [b for d in beat_dirs for b in read_beats(d)]
        if len(beats) == 2 and all(b.phase == "step" and b.step >= step for b in beats):
            return beats
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not reach step {step} within {timeout_s} s: {beats}")


def test_a_stopped_rank_is_a_hang_named_with_every_ranks_stack(prepared_data, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", "--nodes", "2", "--hang-timeout-s", str(HANG_TIMEOUT_S),
        "--", *prepared_data, *FAST, "--max-steps", "100000", "--eval-interval", "100000",
        "--checkpoint-interval", "100000",
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_id = only_job_id(jobs)
    job_dir = jobs / job_id
    beats = _wait_for_steps([job_dir / "heartbeat" / f"node-{k}" for k in (0, 1)], step=3)
    rank1 = next(b for b in beats if b.rank == 1)
    frozen = time.monotonic()
    os.kill(rank1.pid, signal.SIGSTOP)
    try:
        status = wait_terminal(LocalScheduler(), JobRecord(job_dir), HANG_TIMEOUT_S + 90, poll_s=0.2)
    finally:
        if processes_of(job_id):
            os.kill(rank1.pid, signal.SIGCONT)
    took = time.monotonic() - frozen
    assert status is not None and status.state == "failed", status
    message = status.message
    assert message.startswith("hang: no progress for "), message
    assert "rank 1 (node 1, localhost) is stopped (SIGSTOP?)" in message, message
    assert "rank 0 waits in " in message and f"stacks in {job_dir / 'hang'}/" in message, message
    assert took < HANG_TIMEOUT_S + 30, f"the hang was reported {took:.0f} s after the freeze"
    stacks = {p.name: p.read_text() for p in (job_dir / "hang").iterdir()}
    assert set(stacks) == {"node0-rank0.txt", "node1-rank1.txt"}
    assert "state stopped" in stacks["node1-rank1.txt"] and "MainThread" in stacks["node1-rank1.txt"]
    assert "waits in: -" not in stacks["node0-rank0.txt"] and "MainThread" in stacks["node0-rank0.txt"]
    assert processes_of(job_id) == []
    print(f"\n{message}\nreported {took:.1f} s after the freeze\n{stacks['node0-rank0.txt'][:1500]}")
    assert json.loads((job_dir / "status.json").read_text())["exit_code"] == 1
