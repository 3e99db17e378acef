"""Room for a checkpoint on the run dir's file system: checked before a save, named when a write
does not fit.

Before a save, the bytes it needs are known: the larger of its tensor storages' bytes and the newest
checkpoint's size (the same model and optimizer: the size the last one took, zip headers and all).
When the file system lacks them, the checkpoints that rotation (``--keep-checkpoints``) deletes after
this save anyway are deleted first, never the newest whole one; still short, the save is not started
(``NoSpaceError``: nothing to clean up). A write that fails for want of room all the same (the
estimate was short, another process filled the disk, a quota: ENOSPC, EDQUOT) is named the same way;
its temporary file is already gone (``gptlaunch.files.atomic_write``).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from gptlaunch.files import digest_path, free_bytes, no_space
from gptlaunch.snapshots import storage_bytes
from trainer.errors import NoSpaceError


def needed_bytes(state: dict[str, Any], newest: Path | None) -> int:
    """Bytes the checkpoint of ``state`` will take on disk: the larger of its storages' bytes and
    ``newest``'s size (the newest checkpoint, None when there is none)."""
    last = newest.stat().st_size if newest is not None and newest.exists() else 0
    return max(storage_bytes(state), last)


def make_room(older: list[Path], needed: int, run_dir: Path, step: int) -> None:
    """Make sure ``needed`` bytes are free in ``run_dir``, deleting the checkpoints of ``older`` (those
    rotation deletes after this save, oldest first) while they are not.

    Raises NoSpaceError, deleting none, when ``needed`` bytes would not be free even then (they stay
    fallbacks for a resume)."""
    free = free_bytes(run_dir)
    if free + sum(p.stat().st_size for p in older if p.exists()) < needed:  # they would go for nothing
        raise NoSpaceError(describe(run_dir, step, needed, free))
    for path in older:
        if free >= needed:
            return
        path.unlink(missing_ok=True)
        digest_path(path).unlink(missing_ok=True)
        free = free_bytes(run_dir)
    if free < needed:
        raise NoSpaceError(describe(run_dir, step, needed, free))


def named(error: BaseException, run_dir: Path, step: int, needed: int) -> NoSpaceError | None:
    """``error`` of the save of ``step`` as a NoSpaceError when a full file system or quota is behind
    it (``gptlaunch.files.no_space``); None when it is another error."""
    cause = no_space(error)
    if cause is None:
        return None
    what = "over your quota" if cause.errno == errno.EDQUOT else None
    return NoSpaceError(describe(run_dir, step, needed, free_bytes(run_dir), what))


def describe(run_dir: Path, step: int, needed: int, free: int, what: str | None = None) -> str:
    """The one line that names a checkpoint that does not fit."""
    # A write that failed with more free than estimated (the estimate was short; another process
    # wrote meanwhile) needed more than is free now, its temporary file gone.
    needs = f"{_size(needed)}, {_size(free)} free" if needed > free else f"more than the {_size(free)} free"
    full = what or "no space left"
    return f"{full} on {run_dir}'s file system: the checkpoint of step {step:,} needs {needs}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
