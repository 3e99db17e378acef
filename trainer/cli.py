"""``trainer`` command line: ``train``, ``prepare`` and ``sample``.

Exit codes: 0 success, 1 training failed, 2 invalid input (the message names the flag and the fix),
75 stopped by a signal after saving a checkpoint (requeue to resume).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainer import __version__
from trainer.config import PRESETS, TrainConfig
from trainer.contract import EXIT_CHECKPOINTED, EXIT_FAILED, EXIT_OK, EXIT_USAGE

EPILOG = (
    f"exit codes: {EXIT_OK} success, {EXIT_FAILED} training failed, {EXIT_USAGE} invalid input, "
    f"{EXIT_CHECKPOINTED} stopped by a signal after saving a checkpoint (resume with --resume auto)"
)


class UsageError(ValueError):
    """A bad flag value; str() names the flag and the fix."""


def _add(p: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, help: str, **kw: Any) -> None:
    field = flag.lstrip("-").replace("-", "_")
    info = TrainConfig.model_fields[field]
    # Required fields are the ones TrainConfig derives from others: their help says how.
    if not info.is_required() and info.default not in (None, ()) and "default: " not in help:
        default = info.default.value if hasattr(info.default, "value") else info.default
        help = f"{help} (default: {default})"
    p.add_argument(flag, dest=field, default=argparse.SUPPRESS, help=help, **kw)


def _preset_default(field: str) -> str:
    by_preset = ", ".join(f"{name} {shape[field]}" for name, shape in PRESETS.items())
    return f"(default: the preset's: {by_preset})"


def _train_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    _add(
        m,
        "--preset",
        f"model shape preset: {', '.join(f'{k} {v}' for k, v in PRESETS.items())}",
        choices=list(PRESETS),
    )
    _add(m, "--n-layer", f"transformer blocks {_preset_default('n_layer')}", type=int)
    _add(m, "--n-head", f"attention heads {_preset_default('n_head')}", type=int)
    _add(m, "--d-model", f"model width {_preset_default('d_model')}", type=int)
    _add(m, "--block-size", f"context length in tokens {_preset_default('block_size')}", type=int)
    _add(m, "--dropout", "dropout probability", type=float)
    d = p.add_argument_group("data")
    _add(
        d,
        "--dataset",
        "Hugging Face dataset name, e.g. wikitext (default: wikitext when the hub is "
        "reachable, else the embedded Python-docs corpus)",
    )
    _add(d, "--dataset-config", "dataset configuration (default for wikitext: wikitext-2-raw-v1)")
    _add(d, "--text-files", "local text files or globs, one document per line", nargs="+", type=str)
    _add(d, "--data-dir", "prepared data directory (default: RUN_DIR/data)", type=Path)
    _add(d, "--vocab-size", "BPE vocabulary size", type=int)
    _add(
        d,
        "--token-dtype",
        "token file dtype; auto picks uint16 when the vocab fits",
        choices=["auto", "uint16", "uint32"],
    )


def _optim_flags(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("optimization")
    _add(o, "--run-dir", "where checkpoints, metrics and TensorBoard events go", type=Path)
    _add(o, "--max-steps", "optimizer steps to train for", type=int)
    _add(o, "--micro-batch-size", "sequences per rank per micro-step", type=int)
    _add(
        o,
        "--global-batch-tokens",
        "tokens per optimizer step over all ranks; sets gradient "
        "accumulation (default: one micro-batch per rank)",
        type=int,
    )
    _add(o, "--lr", "peak learning rate", type=float)
    _add(o, "--min-lr-ratio", "final learning rate as a fraction of --lr (cosine decay)", type=float)
    _add(o, "--warmup-steps", "linear warmup steps (default: min(100, max_steps/10))", type=int)
    _add(o, "--weight-decay", "AdamW weight decay on matrices", type=float)
    _add(o, "--grad-clip", "gradient-norm clip, 0 disables", type=float)
    _add(o, "--seed", "random seed (weights, data order)", type=int)
    r = p.add_argument_group("runtime")
    _add(
        r,
        "--precision",
        "bf16 autocast (fp16 + loss scaling where bf16 is unsupported) or fp32",
        choices=["bf16", "fp16", "fp32"],
    )
    _add(r, "--compile", "torch.compile the model after the DDP wrap", action=argparse.BooleanOptionalAction)
    _add(
        r,
        "--compile-mode",
        "torch.compile mode; auto: max-autotune-no-cudagraphs on CPU, default on GPU",
        choices=["auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
    )
    _add(r, "--device", "auto, cpu, cuda or cuda:N (auto: cuda:LOCAL_RANK when CUDA is available)")
    _add(
        r,
        "--backend",
        "process-group backend (auto: nccl on CUDA, gloo on CPU)",
        choices=["auto", "nccl", "gloo"],
    )
    _add(r, "--dist-timeout-s", "timeout of every collective, seconds", type=float)
    _add(r, "--peak-flops", "peak FLOP/s of one device for MFU (default: datasheet or measured)", type=float)
    lg = p.add_argument_group("logging and checkpoints")
    _add(lg, "--log-interval", "steps between metric lines", type=int)
    _add(lg, "--eval-interval", "steps between validation runs", type=int)
    _add(lg, "--eval-iters", "validation micro-batches per rank", type=int)
    _add(lg, "--checkpoint-interval", "steps between checkpoints", type=int)
    _add(lg, "--keep-checkpoints", "how many recent checkpoints to keep", type=int)
    _add(lg, "--resume", "auto (newest checkpoint in the run dir), never, or a checkpoint path")
    _add(lg, "--stop-signals", "signals that checkpoint and exit 75", nargs="+", type=str)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainer", description="Train a GPT with DDP (run under torchrun).", epilog=EPILOG
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{train,prepare,sample}")
    t = sub.add_parser(
        "train", help="train (prepares data first when needed)", epilog=EPILOG, allow_abbrev=False
    )
    _train_flags(t)
    _optim_flags(t)
    pr = sub.add_parser(
        "prepare", help="train the tokenizer and write token files, then exit", allow_abbrev=False
    )
    _train_flags(pr)
    _add(pr, "--run-dir", "run directory (its data/ subdirectory is the default --data-dir)", type=Path)
    s = sub.add_parser("sample", help="generate text from the newest checkpoint", allow_abbrev=False)
    s.add_argument("--run-dir", type=Path, required=True, help="run directory holding ckpt-*.pt")
    s.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    s.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default: 100)")
    s.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    s.add_argument("--top-k", type=int, default=200, help="sample among the k likeliest (default: 200)")
    s.add_argument("--seed", type=int, default=1337, help="sampling seed (default: 1337)")
    s.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    return p


def config_from_args(values: dict[str, Any]) -> TrainConfig:
    """Validate parsed flags into a TrainConfig. Raises UsageError naming the flag and the problem."""
    try:
        return TrainConfig(**values)
    except ValidationError as e:
        raise UsageError(_describe(e)) from None


def parse_train_args(argv: Sequence[str]) -> TrainConfig:
    """Parse and validate ``trainer train`` arguments (``trainer.precheck`` checks a job up front with
    it). Raises UsageError (bad value) or SystemExit(2) from argparse (unknown flag)."""
    ns = _parser().parse_args(["train", *argv])
    values = {k: v for k, v in vars(ns).items() if k != "command"}
    return config_from_args(values)


def _describe(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        field = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not field:  # a check across fields: its message names the flags
            lines.append(msg)
            continue
        got = f" (got {err['input']!r})" if "input" in err else ""
        lines.append(f"--{field.replace('_', '-')}: {msg}{got}")
    return "; ".join(lines)


def _run(args: argparse.Namespace) -> int:
    values = {k: v for k, v in vars(args).items() if k != "command"}
    if args.command == "sample":
        from trainer.sample import sample_main

        return sample_main(args)
    cfg = config_from_args(values)
    if args.command == "prepare":
        from trainer.prepare import prepare_data

        prepare_data(cfg.data_dir, cfg.data_source(), vocab_size=cfg.vocab_size, token_dtype=cfg.token_dtype)
        return EXIT_OK
    from trainer.train import train

    return train(cfg)


def _user_errors() -> tuple[type[BaseException], ...]:
    from trainer.checkpoint import CheckpointError
    from trainer.config import ConfigError
    from trainer.corpus import DataError

    return (UsageError, DataError, CheckpointError, ConfigError)


def main(argv: Sequence[str] | None = None) -> int:
    # @record writes a worker's exception to torchrun's error file, so the launcher can name the
    # failing rank and the root cause.
    from torch.distributed.elastic.multiprocessing.errors import record

    from trainer.train import TrainingError

    args = _parser().parse_args(argv)
    try:
        code = record(_run)(args)
    except _user_errors() as e:
        print(f"trainer: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except TrainingError as e:  # already in torchrun's error file (via @record); no traceback needed
        print(f"trainer: training failed: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK if code is None else code


if __name__ == "__main__":
    sys.exit(main())
