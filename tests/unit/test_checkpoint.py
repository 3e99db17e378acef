"""Checkpoints: atomic, checksummed, pruned, never unpickling arbitrary objects, and checked before a
resume."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import pytest
import torch

from gptlaunch import files
from trainer import checkpoint
from trainer.checkpoint import CheckpointError
from trainer.config import TrainConfig


def _state(step: int) -> dict:
    return {"format": checkpoint.FORMAT_VERSION, "step": step, "model": {"w": torch.full((4,), float(step))}}


def test_keeps_only_the_newest_k(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        checkpoint.save(_state(step), tmp_path, step, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-00000020.pt", "ckpt-00000030.pt"]
    assert checkpoint.resume_candidates(tmp_path, "auto") == [
        checkpoint.checkpoint_path(tmp_path, step) for step in (30, 20)
    ]
    assert checkpoint.resume_candidates(tmp_path, "never") == []
    # A checkpoint's checksum file goes with it: none is left for the deleted ckpt-10.
    assert sorted(p.name for p in tmp_path.glob("*.sha256")) == [
        "ckpt-00000020.pt.sha256",
        "ckpt-00000030.pt.sha256",
    ]


def test_crash_during_save_leaves_previous_checkpoint_whole(tmp_path: Path, monkeypatch) -> None:
    checkpoint.save(_state(10), tmp_path, 10, keep=3)

    def dying_save(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(_state(20), tmp_path, 20, keep=3)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-00000010.pt"]
    # No temporary file left behind, nor a checksum of the checkpoint that failed.
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000010.pt", "ckpt-00000010.pt.sha256"]
    assert checkpoint.load(checkpoint.checkpoint_path(tmp_path, 10))["step"] == 10


def test_the_checksum_is_hashed_as_the_checkpoint_is_written_not_read_back(
    tmp_path: Path, monkeypatch
) -> None:
    def no_read_back(*a, **k):
        raise AssertionError("the save read a file back")

    monkeypatch.setattr(files, "sha256_of", no_read_back)
    monkeypatch.setattr(files, "open", no_read_back, raising=False)  # the module's own open()
    path = checkpoint.save(_state(1) | {"optimizer": {"m": torch.randn(256, 256)}}, tmp_path, 1, keep=1)
    monkeypatch.undo()

    written = hashlib.sha256(path.read_bytes()).hexdigest()
    assert files.digest_path(path).read_text() == f"{written}  {path.name}\n"  # sha256sum -c reads it
    assert checkpoint.examine(path) == checkpoint.Verdict(None, checksummed=True)


def test_a_checksum_left_by_a_save_killed_before_its_rename_is_removed(tmp_path: Path) -> None:
    kept = checkpoint.save(_state(10), tmp_path, 10, keep=3)
    orphan = files.digest_path(checkpoint.checkpoint_path(tmp_path, 20))
    orphan.write_text(files.digest_path(kept).read_text())
    checkpoint.remove_partial_saves(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000010.pt", "ckpt-00000010.pt.sha256"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo should-not-run",))


def test_loading_refuses_arbitrary_pickled_objects(tmp_path: Path) -> None:
    path = tmp_path / "ckpt-00000001.pt"
    with open(path, "wb") as f:
        torch.save({"step": 1, "model": {}, "payload": _Evil()}, f, pickle_module=pickle)
    with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
        checkpoint.load(path)


def test_resume_path_that_does_not_exist_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(checkpoint.CheckpointError, match="no such checkpoint"):
        checkpoint.resume_candidates(tmp_path, str(tmp_path / "nope.pt"))


def test_saved_files_are_readable_by_others_as_the_umask_allows(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = checkpoint.save(_state(1), tmp_path, 1, keep=1)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_loading_refuses_another_checkpoint_format(tmp_path: Path) -> None:
    path = checkpoint.save(_state(1) | {"format": 2}, tmp_path, 1, keep=1)
    with pytest.raises(CheckpointError, match="format 2, this trainer reads format 1"):
        checkpoint.load(path)


# ------------------------------------------------------------------------------ resume checks

CKPT = Path("run/ckpt-00000010.pt")
SHAPE = {"vocab_size": 512, "n_layer": 2}
RUN = TrainConfig(lr=1e-3, warmup_steps=2, max_steps=20, min_lr_ratio=0.1)


def _saved(cfg: TrainConfig = RUN, *, step: int = 10, world_size: int = 2, steps_per_epoch: int = 4) -> dict:
    """What save_checkpoint records for a run of ``cfg`` (tensors left out: the check reads none)."""
    return {
        "format": checkpoint.FORMAT_VERSION,
        "step": step,
        "model": {},
        "optimizer": {},
        "rng": [],
        "world_size": world_size,
        "model_shape": SHAPE,
        "tokenizer_sha256": "abc",
        "schedule": checkpoint.schedule_of(cfg),
        "data": checkpoint.data_position(step, steps_per_epoch),
    }


def _check(
    state: dict, cfg: TrainConfig = RUN, *, world_size: int = 2, steps_per_epoch: int = 4
) -> list[str]:
    return checkpoint.check_resumable(
        state,
        CKPT,
        cfg=cfg,
        world_size=world_size,
        steps_per_epoch=steps_per_epoch,
        model_shape=SHAPE,
        tokenizer_sha256="abc",
    )


def test_a_checkpoint_of_the_same_run_resumes_without_notes() -> None:
    assert _check(_saved()) == []


@pytest.mark.parametrize("version", [None, 0, 2, "1"])
def test_resume_refuses_a_missing_or_unknown_format(version: object) -> None:
    state = _saved() | {"format": version}
    if version is None:
        del state["format"]
    with pytest.raises(CheckpointError, match=f"checkpoint format {version!r}"):
        _check(state)


@pytest.mark.parametrize(
    "key",
    [
        *[k for k in checkpoint.REQUIRED_KEYS],
        *[f"{k}.{sub}" for k, subs in checkpoint.REQUIRED_KEYS.items() for sub in subs],
    ],
)
def test_resume_names_a_missing_key(key: str) -> None:
    state = _saved()
    outer, _, inner = key.partition(".")
    if inner:
        state[outer] = {k: v for k, v in state[outer].items() if k != inner}
    else:
        del state[outer]
    with pytest.raises(CheckpointError, match=f"lacks '{key}'"):
        _check(state)


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"lr": 2e-3}, "--lr"),
        ({"min_lr_ratio": 0.0}, "--min-lr-ratio"),
        ({"warmup_steps": 5}, "--warmup-steps"),
    ],
)
def test_resume_refuses_another_schedule(change: dict, flag: str) -> None:
    saved = _saved()
    with pytest.raises(CheckpointError) as excinfo:
        _check(saved, RUN.model_copy(update=change))
    message = str(excinfo.value)
    assert f"resume with the same {flag} {saved['schedule'][change.popitem()[0]]}" in message
    assert "--resume never" in message and "--run-dir" in message


def test_resume_with_another_max_steps_extends_the_run_with_a_note() -> None:
    (note,) = _check(_saved(), RUN.model_copy(update={"max_steps": 40}))
    assert "--max-steps 20" in note and "40" in note and "warmup" not in note
    # The default warmup follows --max-steps: extending a run with the defaults changes both.
    defaults = TrainConfig(max_steps=1000)
    (note,) = _check(_saved(defaults), TrainConfig(max_steps=30))
    assert "warmup 100 -> 3 steps" in note


def test_resume_at_another_world_size_is_allowed_with_a_note() -> None:
    # The batch plan differs too (other steps per epoch): not checked across world sizes.
    (note,) = _check(_saved(world_size=4), world_size=2, steps_per_epoch=7)
    assert "4 ranks" in note and "this run has 2" in note and "not exactly" in note


def test_resume_at_the_same_world_size_refuses_another_data_order() -> None:
    with pytest.raises(CheckpointError, match="data order changed") as excinfo:
        _check(_saved(steps_per_epoch=4), steps_per_epoch=3)  # e.g. another --micro-batch-size
    with pytest.raises(checkpoint.CheckpointError, match="data order changed"):
        # Within the first epoch too: step 2 is epoch 0 + 2 steps either way, but the blocks differ.
        _check(_saved(step=2, steps_per_epoch=40), steps_per_epoch=30)
    assert "'epoch': 2, 'step_in_epoch': 2" in str(excinfo.value) and "'epoch': 3" in str(excinfo.value)
    with pytest.raises(CheckpointError, match="data order changed"):
        # Within the first epoch too: step 2 is epoch 0 + 2 steps either way, but other blocks.
        _check(_saved(step=2, steps_per_epoch=40), steps_per_epoch=30)


def test_resume_refuses_another_model_shape_or_tokenizer() -> None:
    with pytest.raises(CheckpointError, match="model of shape"):
        _check(_saved() | {"model_shape": SHAPE | {"n_layer": 3}})
    with pytest.raises(CheckpointError, match="different tokenizer"):
        _check(_saved() | {"tokenizer_sha256": "def"})
