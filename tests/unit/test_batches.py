"""Rank-strided batches: distinct per rank, equal to one process's global batch, exact by step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.data.batches import BatchPlan, TrainBatches, eval_block_ids

TOKENS = np.arange(10_000, dtype=np.uint16)


def _blocks(batches: TrainBatches, step: int) -> list[list[int]]:
    p = batches.plan
    return [
        batches.block_ids(step, m, r).tolist() for m in range(p.grad_accum_steps) for r in range(p.world_size)
    ]


def test_ranks_read_distinct_blocks_whose_union_is_the_single_process_global_batch() -> None:
    two = TrainBatches(TOKENS, 32, BatchPlan(micro_batch_size=4, grad_accum_steps=2, world_size=2), seed=7)
    one = TrainBatches(TOKENS, 32, BatchPlan(micro_batch_size=8, grad_accum_steps=2, world_size=1), seed=7)
    for step in (0, 1, 5):
        per_rank = _blocks(two, step)
        flat = [b for chunk in per_rank for b in chunk]
        assert len(flat) == len(set(flat)) == 16
        assert sorted(flat) == sorted(b for chunk in _blocks(one, step) for b in chunk)


def test_batches_are_a_pure_function_of_step_and_change_with_epoch() -> None:
    plan = BatchPlan(micro_batch_size=4, grad_accum_steps=1, world_size=2)
    a = TrainBatches(TOKENS, 32, plan, seed=1)
    b = TrainBatches(TOKENS, 32, plan, seed=1)
    later = a.steps_per_epoch + 3
    assert torch.equal(a.block_ids(later, 0, 1), b.block_ids(later, 0, 1))  # no history needed
    assert not torch.equal(a.block_ids(3, 0, 1), a.block_ids(later, 0, 1))  # new epoch, new order


def test_targets_are_inputs_shifted_by_one() -> None:
    batches = TrainBatches(TOKENS, 32, BatchPlan(4, 1, 1), seed=0)
    x, y = batches.get(0, 0, 0)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_too_small_a_dataset_names_the_fix() -> None:
    with pytest.raises(ValueError, match="micro-batch-size"):
        TrainBatches(TOKENS[:100], 32, BatchPlan(4, 1, 2), seed=0)


def test_eval_blocks_are_split_between_ranks_without_overlap() -> None:
    r0 = torch.cat(list(eval_block_ids(10_000, 32, batches=2, batch_size=4, world_size=2, rank=0)))
    r1 = torch.cat(list(eval_block_ids(10_000, 32, batches=2, batch_size=4, world_size=2, rank=1)))
    assert len(r0) == len(r1) == 8
    assert not set(r0.tolist()) & set(r1.tolist())
