"""One optimizer step and one evaluation of a Run.

One optimizer step: ``backward`` runs ``grad_accum_steps`` micro-steps per rank, gradients all-reduced
by DDP only on the last (``no_sync`` covers forward *and* backward of the others, since DDP arms its
reducer in forward), then clips them; ``update`` runs AdamW. ``agree`` makes one small all-reduce that
carries the step's mean loss over ranks, whether any rank was asked to stop, so every rank stops at the
same step, and at a log interval the ranks' compute times for the straggler check
(``agree_before_update`` says where it runs).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer import distributed
from trainer.data.batches import blocks_to_batch, eval_block_ids
from trainer.errors import TrainingError
from trainer.optim import lr_at
from trainer.run import Run
from trainer.stragglers import ComputeClock


def _compute(run: Run) -> contextlib.ExitStack:
    """Autocast to the run's precision and, for compiled CPU runs, attention through the math SDPA
    backend: inductor fuses its matmuls and softmax into kernels that beat the CPU flash-attention
    kernel at these context lengths (its bf16 backward is ~3x slower than fp32; see benchmarks/)."""
    stack = contextlib.ExitStack()
    if run.autocast_dtype is not None:
        stack.enter_context(torch.autocast(device_type=run.device.type, dtype=run.autocast_dtype))
    if run.cfg.compile and run.device.type == "cpu":
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    return stack


def agree_before_update(run: Run) -> bool:
    """Whether ``agree`` runs between ``backward`` and ``update``, not after them: on a CPU. A rank
    whose peer dies then finds out in a collective before its update, while the weights still hold
    the last step whose work ended (``Held``), and keeps that step for the retry
    (``snapshot_on_failure``, CPU only); after its update it would hold no whole step until the loop
    ends this one, and the retry would redo the steps since the last snapshot. On a GPU ``agree``'s
    read of the loss waits for the device: before the update the optimizer's kernels would be
    launched only then, an idle gap in every step."""
    return run.device.type == "cpu"


def backward(run: Run, step: int, clock: ComputeClock | None = None) -> torch.Tensor:
    """Forward and backward passes of one optimizer step, gradients all-reduced and clipped; returns
    this rank's mean micro-batch loss (a 0-d tensor, not synced). ``clock`` times the forward passes
    (this rank's own compute, see ``trainer.stragglers``)."""
    timed = clock.forward if clock is not None else contextlib.nullcontext
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, run.cfg)
    accum = run.batches.plan.grad_accum_steps
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(accum):
        x, y = (t.to(run.device, non_blocking=True) for t in run.batches.get(step, micro, run.env.rank))
        # Only the last micro-step all-reduces gradients; the others accumulate locally.
        last = micro == accum - 1
        sync = contextlib.nullcontext() if run.ddp is None or last else run.ddp.no_sync()
        with sync:
            with _compute(run), timed():
                _, loss = run.step_model(x, y)
            loss_sum += loss.detach()
            scaled = loss / accum
            (run.scaler.scale(scaled) if run.scaler is not None else scaled).backward()
    if clock is not None:
        clock.step_done()
    if run.scaler is not None:
        run.scaler.unscale_(run.optimizer)
    if run.cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.grad_clip)
    return loss_sum / accum


def update(run: Run) -> None:
    """The optimizer's step on the gradients ``backward`` left (through the loss scaler, if any)."""
    # The weights move past the step held: none until this step's work has ended (``Held``).
    run.held.step = None
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def agree(
    run: Run, step: int, local_loss: torch.Tensor, stop_requested: bool, compute_s: float | None = None
) -> tuple[float, bool, list[float] | None]:
    """(the step's loss averaged over ranks, whether any rank got a stop signal, every rank's
    ``compute_s`` in rank order or None): one all-reduce. ``compute_s``, this rank's forward seconds
    per step at a log interval of the straggler check (``trainer.stragglers``), rides in the same
    all-reduce (one slot per rank), so the check adds no collective of its own after the update.

    Raises TrainingError when the loss is not finite (every rank raises: they see the same sum)."""
    env = run.env
    slots = env.world_size if compute_s is not None else 0
    stats = torch.zeros(2 + slots, dtype=torch.float64, device=run.device)
    stats[0], stats[1] = local_loss.detach(), float(stop_requested)
    if compute_s is not None:
        stats[2 + env.rank] = compute_s
    values = distributed.all_reduce_sum(stats).tolist()
    loss, stopping = values[0] / env.world_size, values[1] > 0
    if not math.isfinite(loss):
        raise TrainingError(
            f"loss is {loss} at step {step}: lower --lr, raise --warmup-steps or use --precision fp32"
        )
    return loss, stopping, (values[2:] if compute_s is not None else None)


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean validation loss in nats over all ranks' shards (each rank evaluates its own blocks)."""
    run.model.eval()
    totals = torch.zeros(2, device=run.device)
    env, cfg = run.env, run.cfg
    for ids in eval_block_ids(
        len(run.val_tokens), cfg.block_size, cfg.eval_iters, cfg.micro_batch_size, env.world_size, env.rank
    ):
        x, y = (t.to(run.device) for t in blocks_to_batch(run.val_tokens, ids, cfg.block_size))
        with _compute(run):
            _, loss = run.model(x, y)
        assert loss is not None
        totals += torch.stack([loss.float() * len(ids), torch.tensor(float(len(ids)), device=run.device)])
    distributed.all_reduce_sum(totals)
    run.model.train()
    return (totals[0] / totals[1]).item()
