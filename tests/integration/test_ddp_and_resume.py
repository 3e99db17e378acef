"""DDP correctness against one process, and bitwise-exact resume after a crash (world_size 1 and 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import FAST, losses, metrics, run, torchrun
from trainer.checkpoint import load


def _train(world_size: int, *args: str, env: dict[str, str] | None = None):
    if world_size == 1:
        return run(
            [sys.executable, "-m", "trainer.cli", "train", *args], env={"OMP_NUM_THREADS": "1"} | (env or {})
        )
    return torchrun(world_size, *args, env=env or {})


def test_two_ranks_with_accumulation_take_the_same_step_as_one_process_on_the_global_batch(
    prepared_data, tmp_path: Path
) -> None:
    # Global batch 8 blocks of 128: 2 ranks × micro-batch 2 × 2 accumulation steps, vs 1 process ×
    # micro-batch 4 × 2 accumulation steps over the same blocks.
    common = [
        *prepared_data,
        *FAST,
        "--precision",
        "fp32",
        "--max-steps",
        "1",
        "--warmup-steps",
        "0",
        "--global-batch-tokens",
        str(8 * 128),
    ]
    ddp = _train(2, *common, "--micro-batch-size", "2", "--run-dir", str(tmp_path / "ddp"))
    one = _train(1, *common, "--micro-batch-size", "4", "--run-dir", str(tmp_path / "one"))
    assert ddp.returncode == 0 and one.returncode == 0, ddp.stderr[-2000:] + one.stderr[-2000:]
    assert "grad_accum=2" in ddp.stdout and "grad_accum=2" in one.stdout
    a, b = (load(tmp_path / d / "ckpt-00000001.pt") for d in ("ddp", "one"))
    # AdamW's first moment after one step is (1 - beta1) × the gradient: the averaged gradients match.
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True):
        assert torch.allclose(sa["exp_avg"], sb["exp_avg"], rtol=1e-4, atol=1e-9)
    assert any(s["exp_avg"].abs().max() > 1e-4 for s in a["optimizer"]["state"].values())
    for name, pa in a["model"].items():
        assert torch.allclose(pa, b["model"][name], rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_after_a_crash_continues_the_loss_curve_bitwise(
    world_size: int, prepared_data, tmp_path: Path
) -> None:
    # Dropout on, so the restored per-rank RNG streams matter; the crash comes 3 steps after the last
    # checkpoint, so those steps are redone and their first metrics must be replaced, not duplicated.
    common = [
        *prepared_data,
        *FAST,
        "--dropout",
        "0.1",
        "--max-steps",
        "20",
        "--checkpoint-interval",
        "10",
        "--eval-interval",
        "100",
    ]
    straight = _train(world_size, *common, "--run-dir", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]

    resumed = tmp_path / "resumed"
    crash = _train(world_size, *common, "--run-dir", str(resumed), env={"GPTLAUNCH_FAULT": "0:13"})
    assert crash.returncode != 0 and "injected fault" in crash.stdout + crash.stderr
    assert sorted(losses(resumed)) == list(range(1, 14))
    again = _train(world_size, *common, "--run-dir", str(resumed))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "at step 10" in again.stdout

    steps = [m["step"] for m in metrics(resumed) if "tokens_per_s" in m]
    assert steps == list(range(1, 21))  # steps 11-13 of the crashed attempt were dropped, not repeated
    expected, got = losses(tmp_path / "straight"), losses(resumed)
    assert [got[s] for s in range(11, 21)] == [expected[s] for s in range(11, 21)]
    assert len({expected[s] for s in range(11, 21)}) == 10  # the curve moves: equality is not trivial
