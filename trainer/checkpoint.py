"""Atomic checkpoints that resume a run exactly.

A checkpoint is one ``ckpt-<step>.pt`` file written by global rank 0: it is written to a temporary
name, fsynced, renamed into place and the directory fsynced, so a crash mid-save leaves the previous
checkpoint whole and never a truncated one under a real name. Contents are tensors and plain
containers only, loaded with ``torch.load(weights_only=True)``: loading never unpickles arbitrary
objects.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from trainer.fsutil import atomic_write, atomic_write_text

CKPT_RE = re.compile(r"^ckpt-(\d{8})\.pt$")
# Written by rank 0 after the checkpoint of a stop signal: tells a launcher or scheduler that the run
# stopped cleanly and can be resumed (torchrun reports the ranks' exit code 75 as a plain failure).
STOP_MARKER = "stopped.json"
EXIT_CHECKPOINTED = 75  # EX_TEMPFAIL: stopped by a signal after saving a checkpoint; requeue to resume


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for this run; the message says why and what to do."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / f"ckpt-{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints in ``run_dir``, oldest first (temporary files are never matched)."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if CKPT_RE.match(p.name)]
    return sorted(found, key=lambda p: int(CKPT_RE.match(p.name).group(1)))  # type: ignore[union-attr]


def save(state: dict[str, Any], run_dir: Path, step: int, keep: int) -> Path:
    """Write ``state`` atomically as the checkpoint of ``step``, then delete all but the newest ``keep``.

    Returns the checkpoint's path. Raises OSError if the disk write fails (the previous checkpoints are
    untouched in that case).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(run_dir, step)
    with atomic_write(final) as f:
        torch.save(state, f)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def write_stop_marker(run_dir: Path, step: int, checkpoint_file: Path) -> None:
    """Record, atomically, that the run stopped on a signal after saving ``checkpoint_file``."""
    record = {"step": step, "checkpoint": checkpoint_file.name, "time": time.time()}
    atomic_write_text(run_dir / STOP_MARKER, json.dumps(record))


def read_stop_marker(run_dir: Path, since: float) -> dict[str, Any] | None:
    """The stop record of a run that stopped on a signal at or after ``since`` (epoch seconds)."""
    try:
        record = json.loads((run_dir / STOP_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("time", 0) >= since else None


def clear_stop_marker(run_dir: Path) -> None:
    (run_dir / STOP_MARKER).unlink(missing_ok=True)


def remove_partial_saves(run_dir: Path) -> None:
    """Delete temporary files of saves that were killed midway (they are never read)."""
    for partial in run_dir.glob(".ckpt-*.tmp"):
        partial.unlink(missing_ok=True)


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """Which checkpoint to resume from: ``never`` -> None, ``auto`` -> the newest in ``run_dir`` (None
    if there is none), anything else is a path that must exist (CheckpointError otherwise)."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_file():
        raise CheckpointError(
            f"--resume {resume}: no such checkpoint file; use auto, never or a ckpt-*.pt path"
        )
    return path


def load(path: Path) -> dict[str, Any]:
    """Load a checkpoint onto the CPU without unpickling code objects.

    Raises CheckpointError when the file is not a readable checkpoint of this format.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a corrupt or foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"{path} is not a checkpoint written by this trainer")
    return state
