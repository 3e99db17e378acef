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

from trainer.data.corpus import DataSource
from trainer.errors import ConfigError

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


def _preset_default(field: str) -> str:
    """Help text for a shape field, e.g. "(default: the preset's: tiny 4, gpt2 12)"."""
    by_preset = ", ".join(f"{name} {shape[field]}" for name, shape in PRESETS.items())
    return f"(default: the preset's: {by_preset})"


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
    """Everything a training run needs. Field names match the ``trainer train`` flags, and each
    field's description is its flag's help (``trainer.flags`` generates the flags from the fields).

    The fields without a default here (the model shape, ``data_dir``, ``warmup_steps``) may still be
    omitted: ``_resolve_defaults`` fills them in from the other fields before validation, as their
    descriptions say.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Model; the shape fields default to the preset's. Each field's description is its flag's help.
    preset: PresetName = Field(
        DEFAULT_PRESET, description=f"model shape preset: {', '.join(f'{k} {v}' for k, v in PRESETS.items())}"
    )
    n_layer: int = Field(ge=1, description=f"transformer blocks {_preset_default('n_layer')}")
    n_head: int = Field(ge=1, description=f"attention heads {_preset_default('n_head')}")
    d_model: int = Field(ge=8, description=f"model width {_preset_default('d_model')}")
    block_size: int = Field(ge=8, description=f"context length in tokens {_preset_default('block_size')}")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability")

    # Data
    dataset: str | None = Field(
        None,
        description="Hugging Face dataset name, e.g. wikitext (default: wikitext when the hub is "
        "reachable, else the embedded Python-docs corpus)",
    )
    dataset_config: str | None = Field(
        None, description="dataset configuration (default for wikitext: wikitext-2-raw-v1)"
    )
    text_files: tuple[str, ...] = Field((), description="local text files or globs, one document per line")
    data_dir: Path = Field(description="prepared data directory (default: RUN_DIR/data)")
    vocab_size: int = Field(8192, ge=257, le=2**32, description="BPE vocabulary size")
    token_dtype: Literal["auto", "uint16", "uint32"] = Field(
        "auto", description="token file dtype; auto picks uint16 when the vocab fits"
    )

    # Optimization
    run_dir: Path = Field(DEFAULT_RUN_DIR, description="where checkpoints, metrics and TensorBoard events go")
    max_steps: int = Field(DEFAULT_MAX_STEPS, ge=1, description="optimizer steps to train for")
    micro_batch_size: int = Field(16, ge=1, description="sequences per rank per micro-step")
    global_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens per optimizer step over all ranks; sets gradient accumulation "
        "(default: one micro-batch per rank)",
    )
    lr: float = Field(1e-3, gt=0.0, description="peak learning rate")
    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="final learning rate as a fraction of --lr (cosine decay)"
    )
    warmup_steps: int = Field(ge=0, description="linear warmup steps (default: min(100, max_steps/10))")
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW weight decay on matrices")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1 (no flag)")
    beta2: float = Field(0.95, ge=0.0, lt=1.0, description="AdamW beta2 (no flag)")
    grad_clip: float = Field(1.0, ge=0.0, description="gradient-norm clip, 0 disables")
    seed: int = Field(1337, ge=0, description="random seed (weights, data order)")

    # Runtime
    precision: Precision = Field(
        "bf16", description="bf16 autocast (fp16 + loss scaling where bf16 is unsupported) or fp32"
    )
    compile: bool = Field(True, description="torch.compile the model after the DDP wrap")
    compile_mode: Literal[
        "auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ] = Field(
        "auto", description="torch.compile mode; auto: max-autotune-no-cudagraphs on CPU, default on GPU"
    )
    ddp_optimizer: Literal["auto", "on", "off"] = Field(
        "auto",
        description="compile DDP's model in one graph per gradient bucket, so buckets all-reduce during "
        "the backward (Dynamo's DDPOptimizer); auto: on for GPUs, off on CPUs",
    )
    device: str = Field(
        "auto", description="auto, cpu, cuda or cuda:N (auto: cuda:LOCAL_RANK when CUDA is available)"
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="process-group backend (auto: nccl on CUDA, gloo on CPU)"
    )
    dist_timeout_s: float = Field(600.0, gt=0.0, description="timeout of every collective, seconds")
    peak_flops: float | None = Field(
        None,
        gt=0.0,
        description="peak FLOP/s of one device for MFU (default: datasheet, or measured once per run dir "
        "and host)",
    )

    # Logging, evaluation, checkpoints
    log_interval: int = Field(10, ge=1, description="steps between metric lines")
    # 10 micro-batches every 1,000 steps of one: 1% of the training tokens, llm.c's share (20 batches
    # every 250 steps of 8); every 100 steps took 3% of an eager CPU run's time, ~7% compiled.
    eval_interval: int = Field(1000, ge=1, description="steps between validation runs (and the last step)")
    eval_iters: int = Field(10, ge=1, description="validation micro-batches per rank")
    checkpoint_interval: int = Field(100, ge=1, description="steps between checkpoints")
    keep_checkpoints: int = Field(2, ge=1, description="how many recent checkpoints to keep")
    snapshot_interval: int = Field(
        10,
        ge=0,
        description="steps between snapshots of the training state in each host's memory (/dev/shm), "
        "which the next attempt of a failed job resumes from when newer than the last checkpoint; 0: none",
    )
    async_checkpoints: bool = Field(
        True,
        description="a checkpoint is copied to host memory and written to disk in the background; the "
        "last step's and a stop signal's are written before going on",
    )
    straggler_check: bool = Field(
        True,
        description="at each log interval, share every rank's own compute time (one small all-reduce) and "
        "name a rank slower than 1.25× the median of the other ranks for 3 intervals in a row",
    )
    mlflow: str | None = Field(
        None,
        min_length=1,
        description="MLflow tracking URI (file:///path/mlruns, http://host:5000): rank 0 logs the config "
        "and each log interval's metrics to one MLflow run per launcher job, which its retries go on in; "
        "needs MLflow's client installed",
    )
    mlflow_experiment: str = Field("gpt", min_length=1, description="MLflow experiment of --mlflow's run")
    resume: str = Field(
        "auto", description="auto (newest checkpoint in the run dir), never, or a checkpoint path"
    )
    stop_signals: tuple[str, ...] = Field(
        ("SIGTERM", "SIGUSR2"), description="signals that checkpoint and exit 75"
    )

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

    @field_validator("mlflow")
    @classmethod
    def _mlflow(cls, v: str | None) -> str | None:
        from urllib.parse import urlsplit

        if v is not None:
            try:  # a typo is the user's, said before training: not a failed attempt to retry
                urlsplit(v)
            except ValueError as e:
                raise ValueError(
                    f"{v!r} is not a URI ({e}): give file:///path/mlruns or http://host:5000"
                ) from None
        return v

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

    def resolved_ddp_optimizer(self, device_type: str) -> bool:
        """Whether a compiled DDP model is split at its gradient buckets (Dynamo's DDPOptimizer).

        ``auto``: on GPUs, where the split lets NCCL all-reduce a bucket while the backward computes
        the next. Off on CPUs: there gloo's all-reduce shares the cores with the backward, so the
        overlap gains nothing measurable (``benchmarks/bench_trainer.py``, its d/e), and a
        split graph bypasses AOTAutograd's cache (``fakify_first_call``, torch
        ``_functorch/_aot_autograd/autograd_cache.py``): every new process, a retry's included, then
        traces the joint graph again, about 2.5 s of its first step on the tiny preset here."""
        if self.ddp_optimizer != "auto":
            return self.ddp_optimizer == "on"
        return device_type != "cpu"

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
