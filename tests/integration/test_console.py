"""A clean console: the main job shows our lines and real warnings, not torch's internal chatter (the
compiled job's console: ``test_compiled_ddp.py``)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import missing_component
from tests.integration.conftest import FAST, only_job_id, wait_for, wait_for_steps

SCREEN = (160, 48)  # columns, rows: what a person sees of the job at once


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def _first_screen(command: list[str], cwd: Path, timeout_s: float = 300) -> list[str]:
    """Run ``command`` in a real terminal (a detached tmux session of SCREEN's size) to its end; the
    first screenful of what it printed there, as the rows a person read."""
    if shutil.which("tmux") is None:
        missing_component("tmux is not installed (apt-get install tmux)")
    session = f"gl-console-{os.getpid()}"
    done = cwd / "exit-code"
    shell = f"cd {shlex.quote(str(cwd))} && {shlex.join(command)}; echo $? > {shlex.quote(str(done))}"
    columns, rows = SCREEN
    _tmux("new-session", "-d", "-s", session, "-x", str(columns), "-y", str(rows), shell + "; sleep 600")
    try:
        deadline = time.monotonic() + timeout_s
        while not done.is_file() or not done.read_text().strip():
            assert time.monotonic() < deadline, _tmux("capture-pane", "-p", "-t", session)
            time.sleep(0.5)
        assert done.read_text().strip() == "0", _tmux("capture-pane", "-p", "-S", "-", "-t", session)
        # every row the terminal showed, from the top of its history: the first screen is its first rows
        return _tmux("capture-pane", "-p", "-S", "-", "-t", session).splitlines()[:rows]
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=30)


def test_the_first_screen_of_the_main_job_in_a_real_terminal(
    prepared_data: list[str], tmp_path: Path
) -> None:
    # `make run`'s command, in a terminal: what the newcomer's first screen shows
    command = [
        str(Path(sys.executable).with_name("launcher")), "--jobs-root", str(tmp_path / "jobs"),
        "submit", "--nodes", "2", "--gpus-per-node", "1", "--",
        *prepared_data, *FAST, "--max-steps", "8", "--run-dir", str(tmp_path / "run"),
        "--precision", "fp16",  # a warning of ours that every rank prints, at the same step of setup
    ]  # fmt: skip
    screen = _first_screen(command, tmp_path)
    text = "\n".join(screen)
    assert screen[0].startswith("launcher: job gpt-"), text
    assert "2 node(s) × 1 process(es) on local" in screen[0], text
    assert "step 1/8 | loss" in text, text  # training shows on the first screen
    for noise in ("Server listening", "hostname of the client socket", "Traceback", "WARNING:torch"):
        assert noise not in text, f"{noise!r} on the first screen:\n{text}"
    # what both ranks print alike is one line naming them; what differs is each rank's own
    collapsed = r"^2 nodes \| \[ranks 0-1\]: trainer: warning: --precision fp16 runs in"
    assert any(re.search(collapsed, row) for row in screen), text
    assert not any(re.search(r"\[rank\d\]: trainer: warning: ", row) for row in screen), text
    for rank in (0, 1):
        assert any(f"[rank{rank}]: rank {rank}/2 " in row for row in screen), text


def test_a_retry_is_one_line_and_the_tracebacks_that_follow_from_the_kill_stay_in_the_logs(
    prepared_data: list[str], tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs"
    argv = [
        sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), "submit", "--nodes", "2",
        "--retries", "1", "--retry-backoff-s", "1", "--", *prepared_data, *FAST, "--max-steps", "30",
        "--checkpoint-interval", "10", "--eval-interval", "100000", "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as submit:
        try:
            wait_for(lambda: jobs.is_dir() and any(jobs.iterdir()), 60, "the job record")
            job_dir = jobs / only_job_id(jobs)
            beats = wait_for_steps([job_dir / "heartbeat" / f"node-{k}" for k in (0, 1)], step=12)
            os.kill(next(b.pid for b in beats if b.rank == 1), signal.SIGKILL)  # after step 10's checkpoint
            out, err = submit.communicate(timeout=300)
        finally:
            submit.kill()
    assert submit.returncode == 0, out[-3000:] + err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("launcher: attempt")]
    assert len(said) == 2, err
    assert re.fullmatch(r"launcher: attempt 1 at step \d+: .*rank 1 .*killed by SIGKILL.*; attempt 2 of 2 "
                        r"starts now", said[0]), said  # fmt: skip
    for aftermath in ("ChildFailedError", "SignalException", "Traceback", "Root Cause"):
        assert aftermath not in out, f"{aftermath!r} on the console:\n{out[-3000:]}"
    logs = "".join(p.read_text() for p in (job_dir / "attempts" / "1").glob("node-*.log"))
    # From the step rank 0 held when it saw the failure (past 12), or else step 10's checkpoint.
    kept = re.search(r"kept step (\d+)'s state in this host's memory", logs)
    assert said[1] == f"launcher: attempt 2 of 2 resumed at step {kept[1] if kept else 10}", (said, kept)
    # Each attempt's start-up, part by part, once: the first attempt's before its failure's line.
    lines = err.splitlines()
    starts = [k for k, line in enumerate(lines) if line.startswith("launcher: first step ")]
    assert len(starts) == 2 and starts[0] < lines.index(said[0]) < starts[1], err
    assert re.match(
        r"launcher: first step [\d.]+ s after the start of attempt 2: launch ", lines[starts[1]]
    ), err
    assert "ChildFailedError" in logs  # the node logs keep everything
