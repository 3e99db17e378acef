"""Failure drills (``GPTLAUNCH_FAULT``): a program fault raises in every attempt; a signal, a fault from
outside, is sent in the first attempt only, so that a retry can show it recovers."""

from __future__ import annotations

import signal

import pytest

from trainer.distributed import DistEnv
from trainer.errors import ConfigError
from trainer.faults import FaultInjection

RANK1 = DistEnv(rank=1, local_rank=0, world_size=2)


def _drill(
    monkeypatch: pytest.MonkeyPatch, spec: str, attempt: int = 1, env: DistEnv = RANK1
) -> FaultInjection:
    monkeypatch.setenv("GPTLAUNCH_FAULT", spec)
    monkeypatch.setenv("GPTLAUNCH_JOB_ID", "gpt-test")
    monkeypatch.setenv("GPTLAUNCH_ATTEMPT", str(attempt))
    return FaultInjection.from_env(env)


def test_a_program_fault_raises_in_every_attempt_on_its_rank_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for attempt in (1, 2):
        drill = _drill(monkeypatch, "1:3", attempt)
        drill.check(2)
        with pytest.raises(RuntimeError, match="injected fault on rank 1 at step 3"):
            drill.check(3)
    assert _drill(monkeypatch, "1:3", env=DistEnv(rank=0, local_rank=0, world_size=2)).at_step is None


def test_a_signal_is_sent_in_the_first_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    drill = _drill(monkeypatch, "1:17:SIGKILL")
    assert (drill.at_step, drill.sent) == (17, signal.SIGKILL)
    assert _drill(monkeypatch, "1:17:SIGKILL", attempt=2).at_step is None
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        _drill(monkeypatch, "1:4:SIGUSR1").check(4)  # a handled signal: the step goes on
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [signal.SIGUSR1]


@pytest.mark.parametrize("spec", ["1", "1:x", "1:3:SIGNOPE", "1:3:SIGKILL:9"])
def test_a_malformed_drill_is_a_config_error_naming_the_form(
    monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    with pytest.raises(ConfigError, match="RANK:STEP or RANK:STEP:SIGNAL"):
        _drill(monkeypatch, spec)
