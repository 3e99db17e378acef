"""The hang watchdog against a real frozen rank: a 2-node local job whose rank 1 is stopped with
SIGSTOP from outside the trainer ends as a hang naming rank 1, with every rank's stack, and leaves
nothing behind."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from gptlaunch.contract import read_beats
from launcher.job.record import JobRecord
from launcher.schedulers.local.scheduler import LocalScheduler
from launcher.supervisor.watchdog import POLL_S
from tests.integration.conftest import (
    FAST,
    TINY,
    frozen_until_ended,
    launcher,
    only_job_id,
    processes_of,
    wait_for_steps,
)

HANG_TIMEOUT_S = 10.0


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
    beats = wait_for_steps([job_dir / "heartbeat" / f"node-{k}" for k in (0, 1)], step=3)
    rank1 = next(b for b in beats if b.rank == 1)
    # c10d hands out ranks in the order the nodes join: rank 1 may be on node 0.
    node_of = {b.rank: k for k in (0, 1) for b in read_beats(job_dir / "heartbeat" / f"node-{k}")}
    healthy, stopped = f"node{node_of[0]}-rank0.txt", f"node{node_of[1]}-rank1.txt"
    frozen = time.monotonic()
    status = frozen_until_ended(job_dir, rank1.pid, HANG_TIMEOUT_S + 90)
    took = time.monotonic() - frozen
    assert status is not None and status.state == "failed", status
    message = status.message
    assert message.startswith("hang: no progress for "), message
    # The node agent names its own host: this machine.
    assert f"rank 1 (node {node_of[1]}, {socket.gethostname()}) is stopped (SIGSTOP?)" in message, message
    assert "rank 0 waits in " in message and f"stacks in {job_dir / 'hang'}/" in message, message
    assert took < HANG_TIMEOUT_S + 30, f"the hang was reported {took:.0f} s after the freeze"
    stacks = {p.name: p.read_text() for p in (job_dir / "hang").iterdir()}
    assert set(stacks) == {healthy, stopped}
    assert "state stopped" in stacks[stopped] and "MainThread" in stacks[stopped]
    assert "waits in: -" not in stacks[healthy] and "MainThread" in stacks[healthy]
    # The healthy rank's flight recorder, read from its worker server: the all_reduce it waits in.
    recorder = stacks[healthy].split("Flight recorder: the last collectives:\n")[1].splitlines()
    assert "gloo:all_reduce #" in recorder[-1] and "NOT DONE" in recorder[-1], recorder
    assert "Flight recorder: not asked (the process is stopped)" in stacks[stopped]
    assert processes_of(job_id) == []
    print(f"\n{message}\nreported {took:.1f} s after the freeze\n{stacks[healthy][:1500]}")
    assert json.loads((job_dir / "status.json").read_text())["exit_code"] == 1
    # The report: the hang on the attempt's timeline, and links to both stacks.
    page = Path(launcher(jobs, "report", job_id, check=True).stdout.strip()).read_text()
    timeline = page.split('<div id="chart-attempts"')[1].split("</script>")[0]
    assert '"name":"hangs"' in timeline and "watchdog: no progress for " in timeline, timeline[-2000:]
    for name in (healthy, stopped):
        assert f"<a href='hang/{name}'>" in page


@pytest.mark.alone  # busy loops on a core, or a 2 s step budget
def test_long_evaluations_under_a_tight_step_budget_are_not_a_hang(prepared_data, tmp_path: Path) -> None:
    """``--hang-timeout-s 2`` bounds steps only: each evaluation takes longer (observed here in the
    heartbeats, not assumed), within its own budget, and the job runs to its end."""
    jobs = tmp_path / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", "--nodes", "2", "--hang-timeout-s", "2", "--",
        *prepared_data, *FAST, *TINY, "--max-steps", "6", "--eval-interval", "3", "--eval-iters", "320",
    )  # fmt: skip  # an evaluation: 320 forward passes, against a step's one forward and backward
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_dir = jobs / only_job_id(jobs)
    record, longest = JobRecord(job_dir), {"startup": 0.0, "eval": 0.0}  # seconds seen in each phase
    deadline = time.monotonic() + 300
    while not LocalScheduler().state(record).state.is_terminal and time.monotonic() < deadline:
        for beat in (b for k in (0, 1) for b in read_beats(job_dir / "heartbeat" / f"node-{k}")):
            if beat.phase in longest:
                longest[beat.phase] = max(longest[beat.phase], time.time() - beat.phase_since)
        time.sleep(0.1)
    status = LocalScheduler().state(record)
    assert status.state == "succeeded", status
    # Past the step budget by more than the watchdog's poll: it looked at least once with the
    # evaluation silent for longer than 2 s, so a step budget applied to it would have ended the job.
    assert longest["eval"] > 2 + POLL_S, longest
    print(f"\nlongest phases seen: { {k: round(v, 1) for k, v in longest.items()} }")
