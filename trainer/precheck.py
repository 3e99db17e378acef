"""Up-front check of ``trainer train`` arguments, for launchers and for the trainer itself.

It runs where the job is submitted, before anything is written or started, and imports no torch,
numpy or tokenizers (a launcher answers in a fraction of a second). Checks that read local files
(``--text-files``, ``--resume PATH``) run only where those files are: a SLURM or SSH job's data may
exist only on the cluster. Relative paths are resolved against the current directory, so a launcher
calls this from the trainer's working directory. ``__all__`` is what a launcher may import.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from pathlib import Path

from trainer.config import TrainConfig
from trainer.data.corpus import DataSource, empty_file_error, expand_text_files
from trainer.data.manifest import select_token_dtype
from trainer.errors import ConfigError, DataError, UsageError
from trainer.flags import build_parser, parse_train_args

# What a launcher may use. parse_train_args, expand_text_files and DataError are re-exported: a
# launcher imports only gptlaunch.contract and this module, never the trainer's internals.
__all__ = [
    "DataError",
    "InvalidTrainerArgs",
    "check_config",
    "check_source",
    "check_train_args",
    "expand_text_files",
    "parse_train_args",
    "paths_of",
    "train_flags",
]

_READ_CHUNK = 1 << 16


def train_flags() -> set[str]:
    """Every flag ``trainer train`` takes (``--lr``, ``--max-steps``, ...), from its parser."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for action in commands.choices["train"]._actions for flag in action.option_strings}


class InvalidTrainerArgs(ValueError):
    """The trainer would refuse these arguments; ``str(e)`` names the flag and the fix."""


def check_train_args(argv: Sequence[str], *, world_size: int, files_here: bool = True) -> None:
    """Check ``trainer train`` arguments ``argv`` for a job of ``world_size`` ranks.

    Parses and validates the flags, checks that the global batch splits over ``world_size``, and the
    vocab/dtype pair. With ``files_here`` also that ``--resume PATH`` exists and that every text file
    exists and holds some text; without it, no local path is looked at.
    Raises InvalidTrainerArgs for any user error; argparse's SystemExit (unknown flag, ``--help``)
    and anything else (a bug) propagate unchanged.
    """
    try:
        cfg = parse_train_args(argv)
        check_config(cfg, world_size=world_size, files_here=files_here)
    except (UsageError, DataError, ConfigError) as e:
        raise InvalidTrainerArgs(str(e)) from e


def check_config(cfg: TrainConfig, *, world_size: int, files_here: bool = True) -> None:
    """What ``check_train_args`` checks after parsing, on a validated config.

    Raises ConfigError (batch split, resume path) or DataError (vocab/dtype, text files).
    """
    cfg.grad_accum_steps(world_size)
    if files_here:
        _check_resume_path(cfg.resume)
        check_source(cfg.data_source(), vocab_size=cfg.vocab_size, token_dtype=cfg.token_dtype)
    else:
        select_token_dtype(cfg.vocab_size, cfg.token_dtype)


def check_source(source: DataSource, *, vocab_size: int = 8192, token_dtype: str = "auto") -> None:
    """Cheap check of what ``prepare_data`` would reject: the vocab/dtype pair, and that every text
    file exists and holds some non-blank text (read only until the first non-blank byte, so a large
    corpus costs little). A dataset name is not checked (that needs the Hub). Raises DataError;
    writes nothing."""
    select_token_dtype(vocab_size, token_dtype)
    if not source.text_files:
        return
    for path in expand_text_files(source.text_files):
        if not _has_text(path):
            raise empty_file_error(path)


def _has_text(path: Path) -> bool:
    """Whether ``path`` holds a non-blank byte. Raises DataError when it cannot be read."""
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                if chunk.strip():
                    return True
    except OSError as e:
        raise DataError(f"cannot read text file {path} ({e.strerror}); fix: check its permissions") from e
    return False


def _check_resume_path(resume: str) -> None:
    """Raise ConfigError when ``resume`` names a checkpoint file that does not exist."""
    if resume not in ("auto", "never") and not Path(resume).is_file():
        raise ConfigError(f"--resume {resume}: no such checkpoint file; use auto, never or a path")


def paths_of(argv: Sequence[str]) -> list[Path]:
    """The directories ``trainer train`` with ``argv`` reads or writes: its run dir and data dir, the
    directory of each text file (of a glob: the part before its first wildcard) and of a ``--resume``
    checkpoint, as given (relative ones are the trainer's working directory's). For a container
    runtime that mounts them. Raises what ``parse_train_args`` raises."""
    cfg = parse_train_args(argv)
    found = [Path(cfg.run_dir), Path(cfg.data_dir)]
    for pattern in cfg.text_files:
        literal = os.path.expanduser(re.split(r"[*?\[]", pattern, maxsplit=1)[0])
        found.append(Path(os.path.dirname(literal) or "."))
    if cfg.resume not in ("auto", "never"):
        found.append(Path(cfg.resume).parent)
    return found
