"""Training configuration: one validated pydantic model, filled from the command line.

Unknown fields are rejected and every value is checked here, once, so the training loop can trust it.
Presets and defaults that depend on other fields are resolved during validation: after it, every
field holds the value the run uses. This module imports no torch (launchers check arguments with it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer.corpus import DataSource

# Model shapes by name; every field can still be overridden on the command line.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 4, "n_head": 4, "d_model": 256, "block_size": 128},  # the CPU default
    "gpt2": {"n_layer": 12, "n_head": 12, "d_model": 768, "block_size": 1024},  # GPT-2 small, 124M
}
PresetName = Literal["tiny", "gpt2"]
DEFAULT_PRESET: PresetName = "tiny"
DEFAULT_RUN_DIR = Path("runs/default")
DEFAULT_MAX_STEPS = 200

Precision = Literal["bf16", "fp16", "fp32"]


class ConfigError(ValueError):
    """A configuration that cannot run here (e.g. a global batch that does not split over the ranks);
    the message names the flag and the fix. The trainer exits 2 on it."""


# Signals a handler cannot catch, or that arrive for other reasons (a child exiting).
UNCATCHABLE_SIGNALS = ("SIGKILL", "SIGSTOP", "SIGCHLD")


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``d_model`` must be divisible by ``n_head``; ``block_size`` is in tokens."""

    vocab_size: int
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    dropout: float = 0.0
    bias: bool = True


class TrainConfig(BaseModel):
    """Everything a training run needs. Field names match the ``trainer train`` flags.

    The fields without a default here (the model shape, ``data_dir``, ``warmup_steps``) may still be
    omitted: ``_resolve_defaults`` fills them in from the other fields before validation, as their
    comments say.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Model; the shape fields default to the preset's.
    preset: PresetName = DEFAULT_PRESET
    n_layer: int = Field(ge=1)  # default: the preset's
    n_head: int = Field(ge=1)  # default: the preset's
    d_model: int = Field(ge=8)  # default: the preset's
    block_size: int = Field(ge=8, description="context length T in tokens")  # default: the preset's
    dropout: float = Field(0.0, ge=0.0, lt=1.0)

    # Data
    dataset: str | None = None
    dataset_config: str | None = None
    text_files: tuple[str, ...] = ()
    data_dir: Path  # default: run_dir / "data"
    vocab_size: int = Field(8192, ge=257, le=2**32)
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"

    # Optimization
    run_dir: Path = DEFAULT_RUN_DIR
    max_steps: int = Field(DEFAULT_MAX_STEPS, ge=1)
    micro_batch_size: int = Field(16, ge=1)
    global_batch_tokens: int | None = Field(None, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(ge=0)  # default: min(100, max_steps // 10)
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

    @model_validator(mode="before")
    @classmethod
    def _resolve_defaults(cls, data: Any) -> Any:
        """Fill the preset's shape and the derived defaults into the raw input, field by field (an
        explicit value always wins). A raw value of the wrong type is left for field validation to
        report; the defaults derived from it then take a harmless stand-in, so one mistake gives one
        error."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        preset = PRESETS.get(data.get("preset", DEFAULT_PRESET), PRESETS[DEFAULT_PRESET])
        for field, value in preset.items():
            if data.get(field) is None:
                data[field] = value
        if data.get("data_dir") is None:
            run_dir = data.get("run_dir", DEFAULT_RUN_DIR)
            data["data_dir"] = Path(run_dir if isinstance(run_dir, str | os.PathLike) else "") / "data"
        if data.get("warmup_steps") is None:
            max_steps = data.get("max_steps", DEFAULT_MAX_STEPS)
            valid = isinstance(max_steps, int) and not isinstance(max_steps, bool)
            data["warmup_steps"] = min(100, max(0, max_steps) // 10) if valid else 0
        return data

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
        if self.d_model % self.n_head:
            raise ValueError(f"--d-model ({self.d_model}) must be divisible by --n-head ({self.n_head})")
        if self.dataset and self.text_files:
            raise ValueError("give either --dataset or --text-files, not both")
        return self

    def data_source(self) -> DataSource:
        """Where the training text comes from (neither dataset nor text files: automatic)."""
        return DataSource(self.dataset, self.dataset_config, tuple(self.text_files))

    def resolved_compile_mode(self, device_type: str) -> str:
        """The torch.compile mode for a device of type ``device_type`` ("cpu", "cuda", ...).

        ``auto``: max-autotune on the CPU, where inductor's autotuning of its GEMM templates takes
        seconds and gains ~10% here; the default mode on GPUs, where autotuning takes minutes."""
        if self.compile_mode != "auto":
            return self.compile_mode
        return "max-autotune-no-cudagraphs" if device_type == "cpu" else "default"

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """Model shape for a tokenizer of ``vocab_size`` tokens, padded up to a multiple of 64 so the
        embedding and LM-head matmuls hit efficient kernel tiles (the pad rows are never targets)."""
        padded = (vocab_size + 63) // 64 * 64
        return GPTConfig(
            vocab_size=padded,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_model=self.d_model,
            dropout=self.dropout,
        )

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-steps per optimizer step so that one step sees ``global_batch_tokens`` tokens.

        Raises ConfigError when the global batch is not a whole number of micro-batches across ranks.
        """
        per_micro_step = self.micro_batch_size * self.block_size * world_size
        if self.global_batch_tokens is None:
            return 1
        if self.global_batch_tokens % per_micro_step:
            raise ConfigError(
                f"--global-batch-tokens {self.global_batch_tokens} is not divisible by "
                f"micro_batch_size × block_size × world_size = {self.micro_batch_size} × "
                f"{self.block_size} × {world_size} = {per_micro_step}: use a multiple of {per_micro_step}"
            )
        return self.global_batch_tokens // per_micro_step
