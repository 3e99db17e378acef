"""The ``trainer`` command line's parser: ``train`` and ``prepare`` flags generated from TrainConfig.

Each ``train``/``prepare`` flag is ``--`` + a TrainConfig field name with dashes; its type, choices,
help (the field's description) and shown default come from the field, so TrainConfig is the one
source of what the trainer accepts. ``FLAG_GROUPS`` only orders the flags into help sections (as
the launcher's flag table does). Imports no torch: ``trainer.precheck`` parses with it.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from gptlaunch import package_version
from gptlaunch.runtime import EXIT_CHECKPOINTED, EXIT_FAILED, EXIT_OK, EXIT_USAGE
from trainer.config import TrainConfig
from trainer.errors import UsageError

EPILOG = (
    f"exit codes: {EXIT_OK} success, {EXIT_FAILED} training failed, {EXIT_USAGE} invalid input, "
    f"{EXIT_CHECKPOINTED} stopped by a signal after saving a checkpoint (resume with --resume auto)"
)
MODEL_GROUP, DATA_GROUP = "model", "data"
# Help section -> the TrainConfig fields it shows, in order. Every field is in one section except
# CODE_ONLY ones (a unit test checks it).
FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    MODEL_GROUP: ("preset", "n_layer", "n_head", "d_model", "block_size", "dropout"),
    DATA_GROUP: ("dataset", "dataset_config", "text_files", "data_dir", "vocab_size", "token_dtype"),
    "optimization": (
        *("run_dir", "max_steps", "micro_batch_size", "global_batch_tokens", "lr", "min_lr_ratio"),
        *("warmup_steps", "weight_decay", "grad_clip", "seed"),
    ),
    "runtime": (
        "precision",
        "compile",
        "compile_mode",
        "ddp_optimizer",
        "device",
        "backend",
        "dist_timeout_s",
        "peak_flops",
    ),
    "logging and checkpoints": (
        *("log_interval", "eval_interval", "eval_iters", "checkpoint_interval", "keep_checkpoints"),
        *("snapshot_interval", "async_checkpoints", "resume", "stop_signals", "straggler_check"),
        *("mlflow", "mlflow_experiment"),
    ),
}
CODE_ONLY = ("beta1", "beta2")  # AdamW betas: GPT-2's values, no flag
PREPARE_RUN_DIR_HELP = "run directory (its data/ subdirectory is the default --data-dir)"

ArgGroup = argparse.ArgumentParser | argparse._ArgumentGroup


def build_parser() -> argparse.ArgumentParser:
    """The whole ``trainer`` parser: ``train``, ``prepare`` and ``sample`` subcommands."""
    p = argparse.ArgumentParser(
        prog="trainer", description="Train a GPT with DDP (run under torchrun).", epilog=EPILOG
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{train,prepare,sample}")
    train = sub.add_parser(
        "train", help="train (prepares data first when needed)", epilog=EPILOG, allow_abbrev=False
    )
    for group, fields in FLAG_GROUPS.items():
        add_field_flags(train.add_argument_group(group), fields)
    prepare = sub.add_parser(
        "prepare", help="train the tokenizer and write token files, then exit", allow_abbrev=False
    )
    for group in (MODEL_GROUP, DATA_GROUP):
        add_field_flags(prepare.add_argument_group(group), FLAG_GROUPS[group])
    add_field_flag(prepare, "run_dir", help=PREPARE_RUN_DIR_HELP)
    sample = sub.add_parser("sample", help="generate text from the newest checkpoint", allow_abbrev=False)
    _sample_flags(sample)
    return p


def _sample_flags(s: argparse.ArgumentParser) -> None:
    # Not TrainConfig fields: sampling reads a checkpoint, it configures no run.
    s.add_argument("--run-dir", type=Path, required=True, help="run directory holding ckpt-*.pt")
    s.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    s.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default: 100)")
    s.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    s.add_argument("--top-k", type=int, default=200, help="sample among the k likeliest (default: 200)")
    s.add_argument("--seed", type=int, default=1337, help="sampling seed (default: 1337)")
    s.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")


def add_field_flags(target: ArgGroup, fields: Sequence[str]) -> None:
    for field in fields:
        add_field_flag(target, field)


def add_field_flag(target: ArgGroup, field: str, help: str | None = None) -> None:
    """Add ``--<field>`` for TrainConfig ``field``, typed from its annotation. ``help`` replaces the
    field's description. Flags not given are absent from the namespace (the config's default wins)."""
    info = TrainConfig.model_fields[field]
    kw = _argparse_kind(info.annotation)
    target.add_argument(
        "--" + field.replace("_", "-"),
        dest=field,
        default=argparse.SUPPRESS,
        help=_help(info, info.description if help is None else help),
        **kw,
    )


def _argparse_kind(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a field's annotation: ``type``, ``choices``, ``nargs`` or ``action``.

    Raises TypeError for an annotation no flag can express (a new field of a new kind needs a case)."""
    if get_origin(annotation) in (Union, types.UnionType):  # X | None: the flag takes an X
        (annotation,) = [a for a in get_args(annotation) if a is not type(None)]
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(annotation) is Literal:
        return {"choices": list(get_args(annotation))}
    if get_origin(annotation) is tuple:  # tuple[str, ...]: one or more values
        return {"nargs": "+", "type": get_args(annotation)[0]}
    if annotation in (int, float, Path):
        return {"type": annotation}
    if annotation is str:
        return {}
    raise TypeError(f"no flag kind for a TrainConfig field of type {annotation!r}")


def _help(info: FieldInfo, text: str | None) -> str:
    """The help text, with the field's default appended unless the text says it already. Required
    fields are the ones TrainConfig derives from others: their description says how."""
    text = text or ""
    if not info.is_required() and info.default not in (None, ()) and "default: " not in text:
        default = info.default.value if hasattr(info.default, "value") else info.default
        text = f"{text} (default: {default})"
    return text


def config_from_args(values: dict[str, Any]) -> TrainConfig:
    """Validate parsed flags into a TrainConfig. Raises UsageError naming the flag and the problem."""
    try:
        return TrainConfig(**values)
    except ValidationError as e:
        raise UsageError(_describe(e)) from None


def parse_train_args(argv: Sequence[str]) -> TrainConfig:
    """Parse and validate ``trainer train`` arguments (``trainer.precheck`` checks a job up front with
    it). Raises UsageError (bad value) or SystemExit(2) from argparse (unknown flag)."""
    ns = build_parser().parse_args(["train", *argv])
    return config_from_args(flag_values(ns))


def flag_values(ns: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig values given on the command line (the subcommand's name left out)."""
    return {k: v for k, v in vars(ns).items() if k != "command"}


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
