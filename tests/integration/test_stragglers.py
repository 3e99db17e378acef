"""Stragglers against real contention: two local ranks, each pinned to its own core; nobody is named
while they run alone, and rank 1 is named (metrics.jsonl, the console, `launcher status`) once a busy
loop shares its core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.integration.conftest import FAST, launcher, only_job_id, wait_for_steps

LOG_INTERVAL = 5


def _stragglers_in_status(jobs: Path, job_id: str) -> dict[str, float]:
    """Every node's stragglers in ``status --json``, by rank (c10d decides which node holds a rank)."""
    out = launcher(jobs, "status", job_id, "--json", check=True).stdout
    return {rank: ratio for node in json.loads(out)["nodes"] for rank, ratio in node["stragglers"].items()}


def _pin(pid: int, core: int) -> None:
    """Every thread of ``pid`` onto ``core`` (threads started later inherit it from theirs)."""
    for thread in psutil.Process(pid).threads():
        os.sched_setaffinity(thread.id, {core})


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait_for_log_intervals(run_dir: Path, after_step: int, n: int, timeout_s: float = 240) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logged = [r for r in _records(run_dir) if "tokens_per_s" in r and r["step"] > after_step]
        if len(logged) >= n:
            return logged
        time.sleep(0.5)
    raise AssertionError(f"{n} log intervals after step {after_step} not reached in {timeout_s} s")


def test_a_rank_sharing_its_core_with_a_busy_loop_is_named_and_nobody_before(
    prepared_data, tmp_path: Path
) -> None:
    assert len(os.sched_getaffinity(0)) >= 2, "this test pins the two ranks to two different cores"
    jobs = tmp_path / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", "--nodes", "2", "--", *prepared_data, *FAST,
        "--log-interval", str(LOG_INTERVAL), "--max-steps", "100000", "--eval-interval", "100000",
        "--checkpoint-interval", "100000",
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_id = only_job_id(jobs)
    job_dir, run_dir = jobs / job_id, jobs / job_id / "run"
    busy = None
    try:
        beats = wait_for_steps([job_dir / "heartbeat" / f"node-{k}" for k in (0, 1)], step=1)
        for beat in beats:
            _pin(beat.pid, beat.rank)
        alone = _wait_for_log_intervals(run_dir, after_step=beats[0].step + LOG_INTERVAL, n=4)
        assert not any("stragglers" in r for r in alone), alone
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(busy.pid, {1})
        shared = _wait_for_log_intervals(run_dir, after_step=alone[-1]["step"], n=4)
        named = [r["stragglers"] for r in shared if "stragglers" in r]
        assert named, shared
        (straggler,) = named[-1]
        assert (straggler["rank"], straggler["node"]) == (1, 1) and straggler["ratio"] > 1.25, straggler
        # Rank 1 (the slow one) publishes its beat after rank 0 wrote the metrics line: wait for it.
        deadline = time.monotonic() + 60
        while not (in_status := _stragglers_in_status(jobs, job_id)):
            assert time.monotonic() < deadline, "rank 1's beat did not name it a straggler within 60 s"
            time.sleep(0.5)
        assert set(in_status) == {"1"} and in_status["1"] > 1.25, in_status
        text = launcher(jobs, "status", job_id, check=True).stdout
        assert "straggler: rank 1 at " in text, text
        log = "".join((job_dir / f"node-{k}.log").read_text() for k in (0, 1))  # rank 0's, wherever it is
        assert "straggler: rank 1 on node 1 (" in log, log[-2000:]
        print(f"\n{text}\n{next(line for line in log.splitlines() if 'straggler' in line)}")
    finally:
        if busy is not None:
            busy.kill()
        launcher(jobs, "cancel", job_id)
