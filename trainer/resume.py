"""Which checkpoint a run resumes from: the newest whole one, the same on every rank.

Rank 0 lists the candidates (``checkpoint.resume_candidates``) and tells the other ranks. Each node's
local rank 0 examines its own view of a candidate (``checkpoint.examine``: a node-local run dir is a
copy that may differ from rank 0's; the ranks of one node see one file) and every rank gets every
node's verdict, so that all ranks go on from the same checkpoint, or all from none. A damaged one is
skipped for the next older: rank 0 moves its own damaged copy, with its checksum file, into
``RUN_DIR/damaged/`` (bytes intact, never deleted; out of ``list_checkpoints``' sight, so nothing loads,
counts or rotates it again) and warns in one line naming it, why, and the checkpoint used instead (on
the console, and in ``launcher status`` while the run goes on). A
damaged ``--resume PATH`` is an error naming it, and the file stays where the user put it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from gptlaunch import runtime
from gptlaunch.files import digest_path, fsync_dir
from trainer import checkpoint, distributed
from trainer.checkpoint import Verdict
from trainer.distributed import DistEnv
from trainer.errors import CheckpointError

DAMAGED_DIR = "damaged"  # in the run dir: where damaged checkpoints are set aside

Damage = tuple[int, str]  # (a rank whose node holds a damaged copy, why it is damaged)


def candidates(run_dir: Path, resume: str, env: DistEnv) -> list[Path]:
    """Rank 0's ``checkpoint.resume_candidates(run_dir, resume)`` (newest first), on every rank.
    Collective. Raises CheckpointError on every rank when ``resume`` names no file."""
    found: list[Path] | str = []
    if env.is_main:
        try:
            found = checkpoint.resume_candidates(run_dir, resume)
        except CheckpointError as e:
            found = str(e)  # raised on every rank below: none is left waiting for rank 0
    found = distributed.broadcast_object(found)
    if isinstance(found, str):
        raise CheckpointError(found)
    return found


def first_whole(found: Sequence[Path], *, explicit: bool, env: DistEnv) -> Path | None:
    """The first of ``found`` (newest first) that is whole on every node; None when none is.
    Collective. Rank 0 sets aside its damaged copies of those before it, and prints one line for
    them (and a note when the one used has no checksum). ``explicit``: ``found`` is a --resume
    PATH, which is never moved.

    Raises CheckpointError naming the file and why when ``explicit`` and it is damaged.
    """
    set_aside: list[str] = []  # rank 0's phrase for each damaged checkpoint
    for path in found:
        examined = checkpoint.examine(path) if env.local_rank == 0 or env.is_main else None
        verdicts: list[Verdict | None] = distributed.all_gather_object(examined)
        damage = [(rank, v.damage) for rank, v in enumerate(verdicts) if v is not None and v.damage]
        if not damage:
            _say(env, set_aside, path, verdicts[0])
            return path
        if explicit:
            raise CheckpointError(
                f"--resume {path}: {_damaged(damage)}; pass another checkpoint, or --resume auto for "
                "the newest whole one in the run dir"
            )
        if env.is_main:
            set_aside.append(_set_aside_phrase(path, damage))
    _say(env, set_aside, None, None)
    return None


def set_aside(path: Path) -> Path:
    """Move the damaged checkpoint ``path``, and its checksum file, into ``damaged/`` beside it under
    the same name (``NAME.1``, ``NAME.2``... when taken). Returns its new path. Raises OSError."""
    aside = path.parent / DAMAGED_DIR
    aside.mkdir(exist_ok=True)
    target, n = aside / path.name, 0
    while target.exists() or digest_path(target).exists():
        n += 1
        target = aside / f"{path.name}.{n}"
    # The checkpoint first: once it is off its name nothing reads it, whatever happens next.
    os.replace(path, target)
    if digest_path(path).exists():
        os.replace(digest_path(path), digest_path(target))
    fsync_dir(aside)
    fsync_dir(path.parent)
    return target


def _set_aside_phrase(path: Path, damage: list[Damage]) -> str:
    """Rank 0's move of its copy of ``path`` when that copy is the damaged one, in words."""
    if damage[0][0] != 0:  # only another node's copy: rank 0's is whole and stays
        return f"{path.name} {_damaged(damage)}, left in place"
    try:
        return f"{path.name} {_damaged(damage)}, moved to {set_aside(path)}"
    except OSError as e:
        return f"{path.name} {_damaged(damage)}, could not be moved aside ({e})"


def _damaged(damage: list[Damage]) -> str:
    rank, why = damage[0]
    return f"is damaged ({why})" if rank == 0 else f"is damaged on the node of rank {rank} ({why})"


def _say(env: DistEnv, set_aside: list[str], used: Path | None, verdict: Verdict | None) -> None:
    """Rank 0's lines: one for the damaged checkpoints set aside (none: nothing), one note when the
    one used has no checksum."""
    if not env.is_main:
        return
    if set_aside:
        then = f"resuming from {used}" if used is not None else "no whole checkpoint left: starting at step 0"
        runtime.warn(f"checkpoint {'; '.join(set_aside)}; {then}", topic="resume")  # in ``status`` too
    if used is not None and verdict is not None and not verdict.checksummed:
        print(
            f"note: {used} has no checksum (written before checkpoints carried one): checked by the "
            "CRC-32s of its zip records only",
            flush=True,
        )
