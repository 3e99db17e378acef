"""The default (optimized) configuration on the CPU: torch.compile after the DDP wrap, bf16 autocast,
two ranks over gloo, as the main job runs it. The GPU paths (NCCL, CUDA bf16) share this code; this is
their CPU stand-in. One compiled job (compiling is most of this suite's slowest minute) serves both the
numbers and the console."""

from __future__ import annotations

import math
from pathlib import Path

from tests.integration.conftest import launcher, losses, metrics, torchrun

CHATTER = ("AUTOTUNE", "Autotune Choices", "TypedStorage", "Profiler record function")


def test_the_compiled_main_job_matches_eager_at_the_first_step_with_no_torch_chatter_on_the_console(
    prepared_data: list[str], tmp_path: Path
) -> None:
    # The smallest shape (compiling is most of the time, and autotuning each matmul takes longer the
    # bigger it is); the trainer's default configuration otherwise.
    shape = ["--n-layer", "1", "--n-head", "2", "--d-model", "64", "--micro-batch-size", "4"]
    common = [*prepared_data, *shape, "--max-steps", "4", "--log-interval", "1", "--eval-iters", "1"]
    # The main job's command with the trainer's default compiled training (max-autotune on the CPU:
    # where the autotune tables and torch's warnings came from), on a cold Inductor cache: with a warm
    # one nothing is autotuned, and the console half would prove nothing.
    compiled = launcher(
        tmp_path / "jobs",
        *("submit", "--nodes", "2", "--gpus-per-node", "1", "--", *common),
        *("--run-dir", str(tmp_path / "compiled")),
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")},
    )
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    eager = torchrun(2, *common, "--no-compile", "--run-dir", str(tmp_path / "eager"))
    assert eager.returncode == 0, eager.stderr[-3000:]
    got, want = losses(tmp_path / "compiled"), losses(tmp_path / "eager")
    assert sorted(got) == [1, 2, 3, 4] and all(math.isfinite(v) for v in got.values())
    # Same weights and data at step 1: compiled kernels may round differently, not compute differently.
    assert abs(got[1] - want[1]) < 0.05, (got[1], want[1])
    assert got[4] < got[1]
    assert [m["world_size"] for m in metrics(tmp_path / "compiled") if "loss" in m][-1] == 2

    lines = compiled.stdout.splitlines()
    before = lines[: next(i for i, line in enumerate(lines) if "step 1/4 | loss" in line)]
    noisy = [line for line in before if any(word in line for word in CHATTER)]
    assert not noisy, "\n".join(noisy)
    assert any("[rank1]: rank 1/2 " in line for line in before)  # our lines are all there
