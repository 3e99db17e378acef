"""The copy of a state to host memory (``gptlaunch.staging``): complete when ``stage`` returns, kept
apart from the state, and correct copy after copy, also under torch 2.11's ``DefaultStager``, which
closes itself after one copy (pytorch/pytorch#183413; here its ``_stage`` made to do the same)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager

from gptlaunch.staging import STAGER_CLOSES_ITSELF, HostStager

CPU = torch.device("cpu")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"step": seed, "model": {"w": torch.randn(4, 3, generator=g)}, "rng": [torch.arange(5) + seed]}


def _copies_are_their_states(stager: HostStager) -> None:
    for seed in range(3):
        state = _state(seed)
        staged = stager.stage(state)
        expected = _state(seed)
        state["model"]["w"].add_(1.0)  # the state goes on changing: the copy must not
        assert staged["step"] == seed
        assert torch.equal(staged["model"]["w"], expected["model"]["w"])
        assert torch.equal(staged["rng"][0], expected["rng"][0])


def test_each_copy_holds_its_state_and_not_what_came_after() -> None:
    stager = HostStager(CPU)
    _copies_are_their_states(stager)
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


def test_a_stager_that_closes_itself_gets_a_new_one_for_each_copy(self_closing_stager: None) -> None:
    with pytest.raises(KeyError):  # the failure as torch 2.11 shows it, on the second copy
        reused = HostStager(CPU, reusable=True)
        reused.stage(_state(0))
        reused.stage(_state(1))
    _copies_are_their_states(HostStager(CPU, reusable=False))


def test_only_the_releases_with_that_stager_take_a_new_one_each_time() -> None:
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert ((2, 11) <= release < (2, 13)) == STAGER_CLOSES_ITSELF
