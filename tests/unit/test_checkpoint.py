"""Checkpoints: atomic, pruned, and never unpickling arbitrary objects."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from trainer import checkpoint


def _state(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((4,), float(step))}}


def test_keeps_only_the_newest_k(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        checkpoint.save(_state(step), tmp_path, step, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-00000020.pt", "ckpt-00000030.pt"]
    assert checkpoint.find_resume(tmp_path, "auto") == checkpoint.checkpoint_path(tmp_path, 30)
    assert checkpoint.find_resume(tmp_path, "never") is None


def test_crash_during_save_leaves_previous_checkpoint_whole(tmp_path: Path, monkeypatch) -> None:
    checkpoint.save(_state(10), tmp_path, 10, keep=3)

    def dying_save(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(_state(20), tmp_path, 20, keep=3)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-00000010.pt"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000010.pt"]  # no temp file left behind
    assert checkpoint.load(checkpoint.checkpoint_path(tmp_path, 10))["step"] == 10


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
        checkpoint.find_resume(tmp_path, str(tmp_path / "nope.pt"))


def test_saved_files_are_readable_by_others_as_the_umask_allows(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = checkpoint.save(_state(1), tmp_path, 1, keep=1)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
