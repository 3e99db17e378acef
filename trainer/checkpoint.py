"""Atomic checkpoints that resume a run exactly, and their schema: what is saved, what a resume checks.

A checkpoint is one ``ckpt-<step>.pt`` file written by global rank 0: it is written to a temporary
name, fsynced, renamed into place and the directory fsynced, so a crash mid-save leaves the previous
checkpoint whole and never a truncated one under a real name. The sha256 of its bytes, hashed as they
are written, goes into ``ckpt-<step>.pt.sha256`` before the checkpoint reaches its name; ``examine``
checks it before a checkpoint is loaded (bytes changed on disk since: a truncated copy, a flipped bit),
and a checkpoint from before checksums by the CRC-32s of torch's zip records. Contents are tensors and
plain containers only, loaded with ``torch.load(weights_only=True)``: loading never unpickles arbitrary
objects. Only this module knows the keys: ``make_state`` builds a checkpoint, ``check_resumable``
checks one against this run, and ``restore``, ``saved_step`` and ``saved_rng`` read one back.
"""

from __future__ import annotations

import re
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptlaunch.files import DIGEST_SUFFIX, DigestError, atomic_write_checked, check_digest, digest_path
from trainer import disk
from trainer.config import TrainConfig
from trainer.errors import CheckpointError

CKPT_RE = re.compile(r"^ckpt-(\d{8})\.pt$")
FORMAT_VERSION = 1  # of a checkpoint's contents (its "format" key); bump when a key's meaning changes
# What a checkpoint must hold to resume a run; nested keys for the dicts among them.
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "step": (),
    "model": (),
    "optimizer": (),
    "rng": (),
    "world_size": (),
    "model_shape": (),
    "tokenizer_sha256": (),
    "schedule": ("lr", "warmup_steps", "max_steps", "min_lr_ratio"),
    "data": ("epoch", "step_in_epoch"),
}
_START_AFRESH = "or start afresh with --resume never or a new --run-dir"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / f"ckpt-{step:08d}.pt"


def step_of(path: Path) -> int | None:
    """The step in a checkpoint's file name (``ckpt-<step>.pt``); None for another name (a path given
    to --resume)."""
    match = CKPT_RE.match(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints in ``run_dir``, oldest first (temporary files are never matched)."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if CKPT_RE.match(p.name)]
    return sorted(found, key=lambda p: int(CKPT_RE.match(p.name).group(1)))  # type: ignore[union-attr]


def save(state: dict[str, Any], run_dir: Path, step: int, keep: int, hold_s: float = 0.0) -> Path:
    """Write ``state`` atomically as the checkpoint of ``step``, then delete all but the newest ``keep``.
    ``hold_s``: seconds the written temporary file stays open before its rename (a failure drill: a
    slow disk).

    Returns the checkpoint's path. Raises NoSpaceError when it does not fit on the run dir's file
    system (``trainer.disk``: checked before the write, named after a failed one), OSError when the
    write fails otherwise; the newest previous checkpoint is untouched in both cases.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(run_dir, step)
    found = list_checkpoints(run_dir)
    needed = disk.needed_bytes(state, found[-1] if found else None)
    # Short of room: those rotation deletes after this save go first; the newest stays, always.
    disk.make_room(found[: max(0, len(found) - max(keep - 1, 1))], needed, run_dir, step)
    try:
        with atomic_write_checked(final) as f:  # the sha256 is hashed on the way to the disk
            torch.save(state, f)
            time.sleep(hold_s)
    except Exception as e:
        if (full := disk.named(e, run_dir, step, needed)) is not None:
            raise full from None  # torch's "unexpected pos" says nothing the user can act on
        raise
    for old in list_checkpoints(run_dir)[:-keep]:  # the damaged ones set aside are not listed
        old.unlink(missing_ok=True)
        digest_path(old).unlink(missing_ok=True)  # after: a checkpoint never loses its digest alone
    return final


def remove_partial_saves(run_dir: Path) -> None:
    """Delete temporary files of saves that were killed midway, and the digests of checkpoints that
    never reached their name (neither is ever read)."""
    for partial in run_dir.glob(".ckpt-*.tmp"):
        partial.unlink(missing_ok=True)
    for digest in run_dir.glob(f"ckpt-*.pt{DIGEST_SUFFIX}"):
        if not digest.with_suffix("").exists():
            digest.unlink(missing_ok=True)


def resume_candidates(run_dir: Path, resume: str) -> list[Path]:
    """The checkpoints a run may resume from, the one to try first first: ``never`` -> none, ``auto``
    -> those in ``run_dir``, newest first, anything else -> that path, which must exist
    (CheckpointError otherwise)."""
    if resume == "never":
        return []
    if resume == "auto":
        return list_checkpoints(run_dir)[::-1]
    path = Path(resume)
    if not path.is_file():
        raise CheckpointError(
            f"--resume {resume}: no such checkpoint file; use auto, never or a ckpt-*.pt path"
        )
    return [path]


@dataclass(frozen=True)
class Verdict:
    """What ``examine`` found of one checkpoint file."""

    damage: str | None  # why it is not whole (checksum mismatch, truncated, unreadable); None: whole
    checksummed: bool  # (whole) checked by the sha256 written with it; False: by its zip's CRC-32s


def examine(path: Path) -> Verdict:
    """Whether the checkpoint at ``path`` holds the bytes it was written with, read without loading
    it: the sha256 in its ``.sha256`` file over all its bytes; for a checkpoint from before checksums,
    the CRC-32 that torch's zip format keeps of each record (every tensor and the pickle; the zip's
    own headers are not covered), which finds a truncated file and most flipped bits. Costs one read
    of the file (sha256 at about 1 GB/s)."""
    try:
        checksummed = check_digest(path)
    except DigestError as e:
        return Verdict(str(e), checksummed=True)
    except OSError as e:
        return Verdict(f"unreadable: {e.strerror or e}", checksummed=True)
    return Verdict(None if checksummed else _zip_damage(path), checksummed)


def _zip_damage(path: Path) -> str | None:
    """Why ``path`` is not a whole zip archive (truncated: no central directory; a record whose
    CRC-32 fails; unreadable); None when it is one."""
    try:
        with zipfile.ZipFile(path) as archive:
            failed = archive.testzip()  # reads every record, checking its CRC-32
    except Exception as e:  # a damaged zip raises many types (BadZipFile, struct.error, OSError, ...)
        return f"not a whole zip archive ({e})"
    return None if failed is None else f"its record {failed} fails its CRC-32"


def load(path: Path, *, examined: bool = False) -> dict[str, Any]:
    """Load a checkpoint onto the CPU without unpickling code objects, after checking its bytes
    (``examine``) unless the caller did (``examined``: a resume examines it on every node first).

    Raises CheckpointError when the file is damaged, or not a readable checkpoint of this format.
    """
    damage = None if examined else examine(path).damage
    if damage is not None:
        raise CheckpointError(f"{path} is damaged ({damage}): use another checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a corrupt or foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"{path} is not a checkpoint written by this trainer")
    _check_format(state, path)
    return state


# ------------------------------------------------------------------------------------- schema


def make_state(
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    rng: Sequence[torch.Tensor],
    cuda_rng: Sequence[torch.Tensor],
    cfg: TrainConfig,
    world_size: int,
    steps_per_epoch: int,
    model_shape: Mapping[str, Any],
    tokenizer_sha256: str,
) -> dict[str, Any]:
    """The checkpoint of a run of ``cfg`` on ``world_size`` ranks before optimizer step ``step``.

    ``rng``/``cuda_rng``: every rank's CPU/CUDA generator state in rank order (``cuda_rng`` empty off
    CUDA); ``steps_per_epoch`` is the batch plan's, ``model_shape`` the GPTConfig as a dict and
    ``tokenizer_sha256`` the prepared data's. What ``check_resumable`` checks is all in here.
    """
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "schedule": schedule_of(cfg),
        "data": data_position(step, steps_per_epoch),
        "rng": list(rng),
        "cuda_rng": list(cuda_rng),
        "world_size": world_size,
        "model_shape": dict(model_shape),
        "config": cfg.model_dump(mode="json"),
        "tokenizer_sha256": tokenizer_sha256,
    }


def restore(
    state: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
) -> None:
    """Load a checked checkpoint's weights, optimizer state and (fp16) loss scale into this run's."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])


def saved_step(state: Mapping[str, Any]) -> int:
    """The optimizer step a resumed run starts at (the steps before it are done)."""
    return int(state["step"])


def saved_rng(
    state: Mapping[str, Any], rank: int, world_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rank ``rank``'s saved (CPU, CUDA) generator states; (None, None) when the checkpoint was
    written by another number of ranks (its streams then do not map onto this run's ranks), and
    CUDA None when it holds none."""
    rng = state["rng"]
    if len(rng) != world_size:
        return None, None
    cuda = state.get("cuda_rng")
    return rng[rank], cuda[rank] if cuda else None


def schedule_of(cfg: TrainConfig) -> dict[str, float | int]:
    """The learning-rate schedule of a run, as a checkpoint records it ("schedule")."""
    return {
        "lr": cfg.lr,
        "warmup_steps": cfg.warmup_steps,
        "max_steps": cfg.max_steps,
        "min_lr_ratio": cfg.min_lr_ratio,
    }


def data_position(step: int, steps_per_epoch: int) -> dict[str, int]:
    """Where the data order stands before optimizer step ``step`` ("data" in a checkpoint): the epoch,
    how many of its steps are done, and ``steps_per_epoch`` itself, which changes with the blocks per
    step (another micro-batch size or global batch changes the data order even within epoch 0)."""
    return {
        "epoch": step // steps_per_epoch,
        "step_in_epoch": step % steps_per_epoch,
        "steps_per_epoch": steps_per_epoch,
    }


def check_resumable(
    state: Mapping[str, Any],
    path: Path | str,
    *,
    cfg: TrainConfig,
    world_size: int,
    steps_per_epoch: int,
    model_shape: Mapping[str, Any],
    tokenizer_sha256: str,
) -> list[str]:
    """Check that the loaded checkpoint ``state`` (from ``path``) can continue this run.

    This run is ``cfg`` on ``world_size`` ranks, whose batch plan has ``steps_per_epoch`` steps per
    epoch, building a model of ``model_shape`` for the tokenizer of ``tokenizer_sha256``.
    Returns notes for the user (a different --max-steps or world size: allowed, not exact).
    Raises CheckpointError, naming the flag and the fix, for an unknown format, a missing key, another
    model shape or tokenizer, another --lr, --min-lr-ratio or --warmup-steps, or (at the same world
    size) a data position that this run's batch plan does not reproduce.
    """
    _check_format(state, path)
    _check_keys(state, path)
    if dict(state["model_shape"]) != dict(model_shape):
        raise CheckpointError(
            f"{path} holds a model of shape {dict(state['model_shape'])}, this run builds "
            f"{dict(model_shape)}: use the same model flags, {_START_AFRESH}"
        )
    if state["tokenizer_sha256"] != tokenizer_sha256:
        raise CheckpointError(
            f"{path} was trained with a different tokenizer (the data changed): {_START_AFRESH}"
        )
    notes = _check_schedule(state["schedule"], schedule_of(cfg), path)
    saved_world_size = int(state["world_size"])
    if saved_world_size != world_size:
        notes.append(
            f"{path} was written by {saved_world_size} ranks, this run has {world_size}: resuming, but "
            "not exactly as an uninterrupted run (random streams are re-seeded per rank and the data "
            "order follows this run's batch plan)"
        )
    else:
        _check_data_position(state, path, steps_per_epoch)
    return notes


def _check_format(state: Mapping[str, Any], path: Path | str) -> None:
    version = state.get("format")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {version!r}, this trainer reads format {FORMAT_VERSION}: "
            f"resume it with the trainer version that wrote it, {_START_AFRESH}"
        )


def _check_keys(state: Mapping[str, Any], path: Path | str) -> None:
    for key, subkeys in REQUIRED_KEYS.items():
        missing = [key] if key not in state else [f"{key}.{sub}" for sub in subkeys if sub not in state[key]]
        if missing:
            raise CheckpointError(f"{path} lacks {missing[0]!r} (a damaged or foreign file): {_START_AFRESH}")


_SCHEDULE_FLAGS = {"lr": "--lr", "min_lr_ratio": "--min-lr-ratio", "warmup_steps": "--warmup-steps"}


def _check_schedule(saved: Mapping[str, Any], mine: Mapping[str, float | int], path: Path | str) -> list[str]:
    """A different --max-steps extends (or shortens) the run: a note. It re-lays the cosine decay,
    and the default --warmup-steps follows --max-steps, so a different warmup comes with it. Any
    other change of the schedule would make the resumed run differ from the one started: an error."""
    extended = saved["max_steps"] != mine["max_steps"]
    for key, flag in _SCHEDULE_FLAGS.items():
        if saved[key] != mine[key] and not (key == "warmup_steps" and extended):
            raise CheckpointError(
                f"{path} was trained with {flag} {saved[key]}, this run has {flag} {mine[key]}: "
                f"resume with the same {flag} {saved[key]}, {_START_AFRESH}"
            )
    if not extended:
        return []
    note = (
        f"{path} was trained towards --max-steps {saved['max_steps']}, this run goes to "
        f"{mine['max_steps']}: the learning-rate schedule is re-laid to the new end"
    )
    if saved["warmup_steps"] != mine["warmup_steps"]:
        note += f" (warmup {saved['warmup_steps']} -> {mine['warmup_steps']} steps)"
    return [note]


def _check_data_position(state: Mapping[str, Any], path: Path | str, steps_per_epoch: int) -> None:
    step = int(state["step"])
    # Checkpoints written before steps_per_epoch was recorded are compared on what they hold.
    expected = {k: v for k, v in data_position(step, steps_per_epoch).items() if k in state["data"]}
    saved = {key: int(state["data"][key]) for key in expected}
    if saved != expected:
        raise CheckpointError(
            f"{path} stopped at step {step} at data position {saved}, but this run's batch plan puts "
            f"step {step} at {expected}: the data order changed (another "
            "--micro-batch-size, --global-batch-tokens or --block-size); resume with the flags the run "
            f"was started with, {_START_AFRESH}"
        )
