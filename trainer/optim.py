"""AdamW with decay/no-decay groups and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import TrainConfig


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW where matrices (embeddings, linear weights: dim >= 2) get weight decay and biases and
    LayerNorm gains do not (decaying them only hurts). The fused kernel is used on CUDA and CPU (one
    kernel for all parameters instead of a loop of small ops)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup over ``warmup_steps`` to
    ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    span = max(1, cfg.max_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)
