"""The copy of a state to host memory (``gptlaunch.staging``): complete when ``stage`` returns, kept
apart from the state, and correct copy after copy of the same state, as a run makes them, also under
torch 2.11's ``DefaultStager``, which closes itself after one copy (pytorch/pytorch#183413; here its
``_stage`` made to do the same), and which the probe (once per process) recognises."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager

from gptlaunch.staging import HostStager, closes_itself

CPU = torch.device("cpu")


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"step": 0, "model": {"w": torch.randn(4, 3, generator=g)}, "rng": [torch.arange(5)]}


def _copies(stager: HostStager, rounds: int = 3) -> list[torch.Tensor]:
    """Copy one state ``rounds`` times, changing it in place between copies as training does; check
    each copy against the state as it was; return each copy's weight tensor."""
    state, weights = _state(), []
    for step in range(rounds):
        state["step"] = step
        expected = state["model"]["w"].clone()
        staged = stager.stage(state)
        state["model"]["w"].add_(1.0)  # the next step, right after the copy returned
        assert staged["step"] == step
        assert torch.equal(staged["model"]["w"], expected)
        assert torch.equal(staged["rng"][0], state["rng"][0])
        weights.append(staged["model"]["w"])
    return weights


def test_a_reused_stager_copies_into_the_same_buffers_each_time() -> None:
    stager = HostStager(CPU, reusable=True)
    first, *later = _copies(stager)
    assert all(w.data_ptr() == first.data_ptr() for w in later)  # so a write must end before the next copy
    stager.close()


@pytest.fixture
def self_closing_stager(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DefaultStager._stage`` as torch 2.11's: it closes its inner stager after each copy."""
    plain = DefaultStager._stage

    def closing(self: DefaultStager, state_dict: dict, **kwargs: object) -> dict:
        try:
            return plain(self, state_dict, **kwargs)
        finally:
            self._state_dict_stager.close()

    monkeypatch.setattr(DefaultStager, "_stage", closing)


def test_a_stager_that_closes_itself_is_recognised_and_replaced_for_each_copy(
    self_closing_stager: None,
) -> None:
    closes_itself.cache_clear()  # the probe runs once per process: again here, under the patch
    try:
        assert closes_itself()
        with pytest.raises(KeyError):  # the failure as torch 2.11 shows it, on the second copy
            _copies(HostStager(CPU, reusable=True))
        weights = _copies(HostStager(CPU))  # the default follows the probe: a new stager for each copy
        assert len({w.data_ptr() for w in weights}) == len(weights)  # each copy in buffers of its own
    finally:
        closes_itself.cache_clear()


def test_this_torchs_stager_is_probed_as_it_behaves() -> None:
    try:  # what the probe should find: whether a reused stager fails on a real state
        _copies(HostStager(CPU, reusable=True))
        fails = False
    except KeyError:
        fails = True
    assert closes_itself() == fails
    _copies(HostStager(CPU))  # whichever way the probe went, copies are right
