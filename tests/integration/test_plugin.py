"""A scheduler defined outside ``launcher/`` (``tests/plugin/``: its nodes start the node agent, nothing
more) gets the hang watch and retries from the launcher, with real processes: a rank frozen with
SIGSTOP after the checkpoint of step 10 is reported as a hang with every rank's stack, and the job's
second attempt resumes from that checkpoint and finishes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from gptlaunch.contract import read_beats
from launcher.job.logs import wait_terminal
from launcher.job.record import Attempt, JobRecord
from tests.integration.conftest import FAST, launcher, only_job_id, processes_of, wait_for_steps
from tests.plugin.queue_scheduler import QueueScheduler
from tests.plugin.registry import installed


def test_a_plugin_scheduler_gets_the_hang_watch_and_retries_from_the_node_agent(
    prepared_data, tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", "--scheduler", "queue", "--queue-name", "gold", "--nodes", "2",
        "--retries", "1", "--retry-backoff-s", "0", "--hang-timeout-s", "5",
        "--", *prepared_data, *FAST, "--max-steps", "20", "--checkpoint-interval", "10",
        "--eval-interval", "100000",
        env=installed(tmp_path / "site"),
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_dir = jobs / only_job_id(jobs)
    wait_for_steps([job_dir / "heartbeat" / f"node-{k}" for k in (0, 1)], step=12)
    # The rendezvous, not the node, gives the ranks: rank 1 is on either node.
    node, rank1 = next(
        (k, b) for k in (0, 1) for b in read_beats(job_dir / "heartbeat" / f"node-{k}") if b.rank == 1
    )
    os.kill(rank1.pid, signal.SIGSTOP)
    final = wait_terminal(QueueScheduler().state, JobRecord(job_dir), 300, poll_s=0.2)
    assert final is not None and final.state == "succeeded", final
    first = Attempt.model_validate_json((job_dir / "attempts" / "1" / "attempt.json").read_text())
    assert first.cause.startswith("hang: no progress"), first.cause
    assert f"rank 1 (node {node}, gold-{node}) is stopped (SIGSTOP?)" in first.cause, first.cause
    stacks = sorted(p.name for p in (job_dir / "attempts" / "1" / "hang").iterdir())
    assert stacks == sorted([f"node{node}-rank1.txt", f"node{1 - node}-rank0.txt"])
    logs = "".join((job_dir / f"node-{k}.log").read_text() for k in (0, 1))
    assert "resumed from" in logs  # attempt 2, from the checkpoint of step 10
    stalled = (job_dir / "attempts" / "1" / f"node-{node}.log").read_text()
    assert "watchdog: no progress" in stalled  # the agent's line, for people; its report is data
    assert processes_of(job_dir.name) == []
