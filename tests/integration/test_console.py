"""A clean console: the main job shows our lines and real warnings, not torch's internal chatter."""

from __future__ import annotations

from pathlib import Path

from tests.integration.conftest import launcher

CHATTER = ("AUTOTUNE", "Autotune Choices", "TypedStorage", "Profiler record function")


def test_the_main_job_console_has_no_torch_chatter_before_the_first_step(
    prepared_data: list[str], tmp_path: Path
) -> None:
    # The main job's command with the trainer's default compiled training (max-autotune on the CPU:
    # where the autotune tables and torch's warnings came from). --precision fp16 on a CPU is a real
    # warning of ours: it runs in bf16 (or fp32 on a CPU without native bf16).
    trainer_args = [*prepared_data, "--max-steps", "2", "--eval-iters", "1", "--log-interval", "1"]
    proc = launcher(
        tmp_path / "jobs",
        *("submit", "--nodes", "2", "--gpus-per-node", "1", "--"),
        *(*trainer_args, "--precision", "fp16", "--run-dir", str(tmp_path / "run")),
        # A cold Inductor cache: with a warm one nothing is autotuned, and the test would prove nothing.
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    first_step = next(i for i, line in enumerate(lines) if "step 1/2 | loss" in line)
    before = lines[:first_step]
    noisy = [line for line in before if any(word in line for word in CHATTER)]
    assert not noisy, "\n".join(noisy)
    ours = [line for line in before if "trainer: warning:" in line and "--precision fp16" in line]
    assert ours, "\n".join(before)
    assert any("[rank1]: rank 1/2 " in line for line in before)  # our lines are all there
