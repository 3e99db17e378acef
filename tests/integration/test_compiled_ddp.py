"""The default (optimized) configuration on the CPU: torch.compile after the DDP wrap, bf16 autocast,
two ranks over gloo. The GPU paths (NCCL, CUDA bf16) share this code; this is their CPU stand-in."""

from __future__ import annotations

import math
from pathlib import Path

from tests.integration.conftest import losses, metrics, torchrun


def test_compiled_bf16_ddp_trains_and_matches_eager_loss_at_the_first_step(
    prepared_data, tmp_path: Path
) -> None:
    common = [*prepared_data, "--max-steps", "4", "--log-interval", "1", "--eval-iters", "1"]
    compiled = torchrun(2, *common, "--run-dir", str(tmp_path / "compiled"))
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    eager = torchrun(2, *common, "--no-compile", "--run-dir", str(tmp_path / "eager"))
    assert eager.returncode == 0, eager.stderr[-3000:]
    got, want = losses(tmp_path / "compiled"), losses(tmp_path / "eager")
    assert sorted(got) == [1, 2, 3, 4] and all(math.isfinite(v) for v in got.values())
    # Same weights and data at step 1: compiled kernels may round differently, not compute differently.
    assert abs(got[1] - want[1]) < 0.05, (got[1], want[1])
    assert got[4] < got[1]
    assert [m["world_size"] for m in metrics(tmp_path / "compiled") if "loss" in m][-1] == 2
