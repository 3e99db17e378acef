"""Training configuration: one validated pydantic model, filled from the command line.

Unknown fields are rejected and every value is checked here, once, so the training loop can trust it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer.model import GPTConfig

# Model shapes by name; every field can still be overridden on the command line.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 4, "n_head": 4, "d_model": 256, "block_size": 128},  # the CPU default
    "gpt2": {"n_layer": 12, "n_head": 12, "d_model": 768, "block_size": 1024},  # GPT-2 small, 124M
}

Precision = Literal["bf16", "fp16", "fp32"]


class ConfigError(ValueError):
    """A configuration that cannot run here (e.g. a global batch that does not split over the ranks);
    the message names the flag and the fix. The trainer exits 2 on it."""


# Signals a handler cannot catch, or that arrive for other reasons (a child exiting).
UNCATCHABLE_SIGNALS = ("SIGKILL", "SIGSTOP", "SIGCHLD")


class TrainConfig(BaseModel):
    """Everything a training run needs. Field names match the ``trainer train`` flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Model
    preset: Literal["tiny", "gpt2"] = "tiny"
    n_layer: int | None = Field(None, ge=1)
    n_head: int | None = Field(None, ge=1)
    d_model: int | None = Field(None, ge=8)
    block_size: int | None = Field(None, ge=8, description="context length T in tokens")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)

    # Data
    dataset: str | None = None
    dataset_config: str | None = None
    text_files: tuple[str, ...] = ()
    data_dir: Path | None = None
    vocab_size: int = Field(8192, ge=257, le=2**32)
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"

    # Optimization
    run_dir: Path = Path("runs/default")
    max_steps: int = Field(200, ge=1)
    micro_batch_size: int = Field(16, ge=1)
    global_batch_tokens: int | None = Field(None, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    warmup_steps: int | None = Field(None, ge=0)
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    grad_clip: float = Field(1.0, ge=0.0)
    seed: int = Field(1337, ge=0)

    # Runtime
    precision: Precision = "bf16"
    compile: bool = True
    compile_mode: Literal[
        "auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ] = "auto"
    device: str = "auto"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    dist_timeout_s: float = Field(600.0, gt=0.0)
    peak_flops: float | None = Field(None, gt=0.0, description="peak FLOP/s of one device, for MFU")

    # Logging, evaluation, checkpoints
    log_interval: int = Field(10, ge=1)
    eval_interval: int = Field(100, ge=1)
    eval_iters: int = Field(10, ge=1)
    checkpoint_interval: int = Field(100, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    resume: str = "auto"
    stop_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR2")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError("use auto, cpu, cuda or cuda:N")

    @field_validator("stop_signals")
    @classmethod
    def _signals(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        import signal

        for name in v:
            if name not in signal.Signals.__members__ or name in UNCATCHABLE_SIGNALS:
                raise ValueError(f"{name!r} cannot be a stop signal: use names like SIGTERM, SIGUSR2")
        return v

    @model_validator(mode="after")
    def _shape(self) -> TrainConfig:
        if self.d_model_ % self.n_head_:
            raise ValueError(f"--d-model ({self.d_model_}) must be divisible by --n-head ({self.n_head_})")
        if self.dataset and self.text_files:
            raise ValueError("give either --dataset or --text-files, not both")
        return self

    # Effective model shape: the preset, overridden field by field.
    @property
    def n_layer_(self) -> int:
        return self.n_layer or PRESETS[self.preset]["n_layer"]

    @property
    def n_head_(self) -> int:
        return self.n_head or PRESETS[self.preset]["n_head"]

    @property
    def d_model_(self) -> int:
        return self.d_model or PRESETS[self.preset]["d_model"]

    @property
    def block_size_(self) -> int:
        return self.block_size or PRESETS[self.preset]["block_size"]

    def compile_mode_(self, device: torch.device) -> str:
        """``auto``: max-autotune on the CPU, where inductor's autotuning of its GEMM templates takes
        seconds and gains ~10% here; the default mode on GPUs, where autotuning takes minutes."""
        if self.compile_mode != "auto":
            return self.compile_mode
        return "max-autotune-no-cudagraphs" if device.type == "cpu" else "default"

    @property
    def data_dir_(self) -> Path:
        return self.data_dir or self.run_dir / "data"

    @property
    def warmup_steps_(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else min(100, self.max_steps // 10)

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """Model shape for a tokenizer of ``vocab_size`` tokens, padded up to a multiple of 64 so the
        embedding and LM-head matmuls hit efficient kernel tiles (the pad rows are never targets)."""
        padded = (vocab_size + 63) // 64 * 64
        return GPTConfig(
            vocab_size=padded,
            block_size=self.block_size_,
            n_layer=self.n_layer_,
            n_head=self.n_head_,
            d_model=self.d_model_,
            dropout=self.dropout,
        )

    def check_resume_path(self) -> None:
        """Raise ConfigError when ``resume`` names a checkpoint file that does not exist."""
        if self.resume not in ("auto", "never") and not Path(self.resume).is_file():
            raise ConfigError(f"--resume {self.resume}: no such checkpoint file; use auto, never or a path")

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-steps per optimizer step so that one step sees ``global_batch_tokens`` tokens.

        Raises ConfigError when the global batch is not a whole number of micro-batches across ranks.
        """
        per_micro_step = self.micro_batch_size * self.block_size_ * world_size
        if self.global_batch_tokens is None:
            return 1
        if self.global_batch_tokens % per_micro_step:
            raise ConfigError(
                f"--global-batch-tokens {self.global_batch_tokens} is not divisible by "
                f"micro_batch_size × block_size × world_size = {self.micro_batch_size} × "
                f"{self.block_size_} × {world_size} = {per_micro_step}: use a multiple of {per_micro_step}"
            )
        return self.global_batch_tokens // per_micro_step
