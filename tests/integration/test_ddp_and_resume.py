"""DDP correctness against one process, and bitwise-exact resume after a crash (world_size 1 and 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import FAST, TINY, losses, metrics, run, torchrun
from trainer.checkpoint import load
from trainer.config import GPTConfig, TrainConfig
from trainer.model import GPT
from trainer.optim import make_optimizer

GRAD_RTOL = 1e-5  # gradients' allowed disagreement, relative to the tensor's largest gradient
K = 30  # "clearly non-zero" gradient: K × (rounding noise + Adam's eps)


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
        *TINY,  # the shape the bounds below were measured on
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
    grads_a, grads_b = _first_moments(a), _first_moments(b)
    assert grads_a.keys() == grads_b.keys()
    # What DDP guarantees: the same averaged gradient, up to summation order. AdamW's first moment after
    # one step is (1 - beta1) × the (clipped) gradient. Rounding noise scales with the tensor's
    # gradients: fp32 sums in another order differ by some ulps of the largest (measured: < 1e-6 of
    # it); a wrong average (a rank's share lost or counted twice) differs by O(1) of it.
    for name, ma in grads_a.items():
        scale = grads_b[name].abs().max()
        assert (ma - grads_b[name]).abs().max() <= GRAD_RTOL * scale, name
    assert any(m.abs().max() > 1e-4 for m in grads_a.values())

    # Parameters after the step, bounded by the update rule, not compared blindly: Adam's first step is
    # p -= lr × g / (|g| + eps) (after the decoupled weight decay, the same in both runs), about
    # lr × sign(g). Where |g| >= K × (noise + eps), with noise the gradients' allowed disagreement, the
    # two runs' g / (|g| + eps) differ by at most noise × eps / |g|² <= 1 / (4 K²); elsewhere by up to 2
    # (a sign flip of a gradient near zero: seen on an AMD EPYC). Both plus the rounding of p's update.
    group = a["optimizer"]["param_groups"][0]
    lr, (beta1, _), eps = group["lr"], group["betas"], group["eps"]
    clear_elements = 0
    for name, ma in grads_a.items():
        pa, pb = a["model"][name], b["model"][name]
        ga, gb = ma / (1 - beta1), grads_b[name] / (1 - beta1)
        noise = GRAD_RTOL * gb.abs().max()
        rounding = 4 * torch.finfo(torch.float32).eps * (pb.abs() + lr)
        clear = torch.minimum(ga.abs(), gb.abs()) >= K * (noise + eps)
        bound = torch.where(clear, lr / (4 * K**2), 2 * lr) + rounding
        excess = (pa - pb).abs() - bound
        assert excess.max() <= 0, f"{name}: {int((excess > 0).sum())} elements beyond the bound"
        clear_elements += int(clear.sum())
    # Not vacuous: the tight bound covers most elements (measured: ~80%).
    assert clear_elements > 0.5 * sum(m.numel() for m in grads_a.values())


def _first_moments(ckpt: dict) -> dict[str, torch.Tensor]:
    """AdamW's exp_avg by parameter name. The optimizer state numbers parameters in the order of its
    groups (see trainer.optim.make_optimizer); rebuilding the model and optimizer recovers the names."""
    model = GPT(GPTConfig(**ckpt["model_shape"]))
    optimizer = make_optimizer(model, TrainConfig(), torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {ordered[i]: state["exp_avg"] for i, state in ckpt["optimizer"]["state"].items()}


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
