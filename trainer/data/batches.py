"""Deterministic, rank-strided batches of fixed-length blocks from a flat token array.

The token stream is cut into non-overlapping blocks of ``block_size`` inputs (+1 shifted target). Each
epoch visits the blocks in a permutation seeded by ``(seed, epoch)``. Optimizer step ``s`` takes the
``s``-th window of ``global_blocks`` blocks of that order, and rank ``r`` reads micro-batch ``m`` at
offset ``(m * world_size + r) * micro_batch_size`` inside the window. So:

- every rank reads distinct data and the same number of batches (nothing hangs on an uneven tail);
- the union over ranks and micro-steps is exactly the global batch a single process would read;
- the data position is a pure function of the step, so resuming at step ``s`` is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainer.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split over ranks and micro-steps."""

    micro_batch_size: int
    grad_accum_steps: int
    world_size: int

    @property
    def global_blocks(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size


class TrainBatches:
    """Training batches: ``get(step, micro_step, rank)`` -> (x, y), each (B, T) int64."""

    def __init__(self, tokens: np.ndarray, block_size: int, plan: BatchPlan, seed: int) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.plan = plan
        self.seed = seed
        self.num_blocks = (len(tokens) - 1) // block_size
        self.steps_per_epoch = self.num_blocks // plan.global_blocks
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"the training split has {self.num_blocks} blocks of {block_size} tokens but one step needs "
                f"{plan.global_blocks}: use more text, or a smaller --micro-batch-size/--global-batch-tokens"
            )
        self._epoch = -1
        self._order = torch.empty(0, dtype=torch.int64)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _order_for(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = torch.randperm(self.num_blocks, generator=g)
            self._epoch = epoch
        return self._order

    def block_ids(self, step: int, micro_step: int, rank: int) -> torch.Tensor:
        """Indices (B,) of the blocks rank ``rank`` reads at ``(step, micro_step)``."""
        order = self._order_for(self.epoch_of(step))
        p = self.plan
        start = (step % self.steps_per_epoch) * p.global_blocks
        start += (micro_step * p.world_size + rank) * p.micro_batch_size
        return order[start : start + p.micro_batch_size]

    def get(self, step: int, micro_step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return blocks_to_batch(self.tokens, self.block_ids(step, micro_step, rank), self.block_size)


def blocks_to_batch(
    tokens: np.ndarray, ids: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather blocks ``ids`` (B,) into inputs x and targets y, both (B, T) int64, y = x shifted by 1."""
    starts = ids.numpy() * block_size
    rows = np.stack([tokens[s : s + block_size + 1] for s in starts]).astype(np.int64)
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


def eval_block_ids(
    num_tokens: int, block_size: int, batches: int, batch_size: int, world_size: int, rank: int
):
    """The validation blocks rank ``rank`` evaluates: the first ``batches * batch_size * world_size``
    blocks of the split (wrapping around a short split), strided by rank. Yields (B,) index tensors."""
    num_blocks = max(1, (num_tokens - 1) // block_size)
    total = batches * batch_size * world_size
    ids = torch.arange(total) % num_blocks
    mine = ids[rank::world_size]
    yield from mine.split(batch_size)
