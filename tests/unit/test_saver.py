"""Checkpoints written in the background (``trainer.saver``): what is saved is the state at the save,
one write at a time, and a failed write is not lost."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer import checkpoint
from trainer.saver import SLOW_WRITE_ENV, Saver


def _state() -> dict:
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return {
        "step": 3,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": [torch.get_rng_state()],
    }


def test_a_background_save_keeps_the_state_as_it_was_when_save_returned(tmp_path: Path) -> None:
    state = _state()
    before = {k: v.clone() for k, v in state["model"].items()}
    with Saver(tmp_path, keep=2, device=torch.device("cpu")) as saver:
        times = saver.save(state, 3, blocking=False)
        for tensor in state["model"].values():  # the next optimizer step changes them in place
            tensor.add_(1.0)
        assert saver.wait() == times.path == checkpoint.checkpoint_path(tmp_path, 3)
    saved = torch.load(times.path, weights_only=True)
    assert all(torch.equal(saved["model"][k], v) for k, v in before.items())
    assert times.background and times.nbytes == sum(
        t.numel() * t.element_size() for t in [*before.values(), state["rng"][0]]
    ) + sum(t.numel() * t.element_size() for s in state["optimizer"]["state"].values() for t in s.values())


def test_a_save_waits_for_the_previous_write_and_both_are_kept(tmp_path: Path, monkeypatch) -> None:
    hold_s = 0.5
    monkeypatch.setenv(SLOW_WRITE_ENV, str(hold_s))
    with Saver(tmp_path, keep=2, device=torch.device("cpu")) as saver:
        first = saver.save(_state(), 10, blocking=False)
        assert first.stall_s < hold_s  # the write goes on after save returned
        second = saver.save(_state(), 20, blocking=True)  # waits for the first, then writes itself
    assert second.waited_s > 0 and second.stall_s >= hold_s
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-00000010.pt", "ckpt-00000020.pt"]
    assert not list(tmp_path.glob(".ckpt-*"))  # no temporary file left


def test_a_failed_background_write_is_raised_at_the_next_save(tmp_path: Path) -> None:
    taken = tmp_path / "run"
    taken.write_text("a file where the run dir should be")
    saver = Saver(taken, keep=2, device=torch.device("cpu"))
    saver.save(_state(), 10, blocking=False)
    with pytest.raises(OSError):
        saver.save(_state(), 20, blocking=False)
    with saver:  # nothing left in flight: leaving it raises nothing
        pass
