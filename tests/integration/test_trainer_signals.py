"""The trainer on its own: a stop signal checkpoints and exits 75; divergence is a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.integration.conftest import FAST, losses, run
from trainer.checkpoint import list_checkpoints, load
from trainer.saver import SLOW_WRITE_ENV


def _signal_once(proc: subprocess.Popen[str], sig: signal.Signals, ready: Callable[[], object]) -> str:
    """Send ``sig`` to the running trainer ``proc`` once ``ready()`` (polled every 50 ms, at most
    120 s); its whole output once it exited."""
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        proc.send_signal(sig)
        return proc.communicate(timeout=60)[0]
    finally:
        proc.kill()


def test_sigusr2_checkpoints_at_a_step_boundary_and_exits_75(prepared_data, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "train",
            *prepared_data,
            *FAST,
            "--max-steps",
            "1000",
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = _signal_once(
        proc, signal.SIGUSR2, lambda: (run_dir / "metrics.jsonl").is_file() and losses(run_dir)
    )
    assert proc.returncode == 75, out[-3000:]
    (ckpt,) = run_dir.glob("ckpt-*.pt")
    assert int(ckpt.stem.split("-")[1]) == max(losses(run_dir))
    assert "stop signal: checkpoint saved" in out


def test_a_diverging_run_stops_with_a_clear_error(prepared_data, tmp_path: Path) -> None:
    proc = run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "train",
            *prepared_data,
            *FAST,
            "--precision",
            "fp32",
            "--lr",
            "1e4",
            "--grad-clip",
            "0",
            "--warmup-steps",
            "0",
            "--max-steps",
            "50",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert proc.returncode == 1
    assert "training failed: loss is nan" in proc.stderr or "training failed: loss is inf" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_second_run_on_the_same_run_dir_is_refused(prepared_data, tmp_path: Path) -> None:
    from filelock import FileLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with FileLock(str(run_dir / ".run.lock")):  # as a running job's rank 0 holds it
        proc = run([sys.executable, "-m", "trainer.cli", "train", *prepared_data, "--run-dir", str(run_dir)])
    assert proc.returncode == 2 and "in use by another run" in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".run.lock"]


def test_a_stop_while_a_checkpoint_is_written_in_the_background_exits_75_with_a_complete_one(
    prepared_data, tmp_path: Path
) -> None:
    """A SIGTERM while the background write of a checkpoint is in flight (held open by the slow-disk
    drill): the stop waits for it, writes its own, exits 75, and the run resumes from it bit for bit."""
    common = [*prepared_data, *FAST, "--dropout", "0.1", "--max-steps", "20", "--checkpoint-interval", "10"]
    common += ["--eval-interval", "100"]
    train = [sys.executable, "-m", "trainer.cli", "train", *common, "--run-dir"]
    straight = run([*train, str(tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr[-3000:]

    run_dir = tmp_path / "stopped"
    env = os.environ | {SLOW_WRITE_ENV: "3"}
    proc = subprocess.Popen(
        [*train, str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    out = _signal_once(proc, signal.SIGTERM, lambda: list(run_dir.glob(".ckpt-*.tmp")))  # step 10's write
    assert proc.returncode == 75, out[-3000:]
    stop_step = max(losses(run_dir))
    assert f"stop signal: checkpoint saved at step {stop_step}" in out
    saved = [load(p)["step"] for p in list_checkpoints(run_dir)]  # both complete, none left half-written
    assert saved == [10, stop_step] and stop_step > 10 and not list(run_dir.glob(".ckpt-*"))

    again = run([*train, str(run_dir)])
    assert again.returncode == 0, again.stderr[-3000:]
    expected, got = losses(tmp_path / "straight"), losses(run_dir)
    assert [got[s] for s in range(stop_step + 1, 21)] == [expected[s] for s in range(stop_step + 1, 21)]
