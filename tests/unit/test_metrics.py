"""The peak FLOP/s that MFU is measured against: measured once per run dir and host, then kept in the
run dir for the run's later attempts (a retry must not pay seconds of matmuls again); the per-rank
numbers of a log interval in TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer import metrics
from trainer.metrics import PEAK_FILE, MetricsWriter, peak_flops

CPU = torch.device("cpu")


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtypes measured, in order (a small real measurement each, not the default 2048² one)."""
    calls: list[torch.dtype] = []
    real = metrics.measure_peak_flops

    def measure(device: torch.device, dtype: torch.dtype) -> float:
        calls.append(dtype)
        return real(device, dtype, n=64, repeats=1)

    monkeypatch.setattr(metrics, "measure_peak_flops", measure)
    return calls


def test_a_measured_peak_is_kept_for_the_runs_next_attempts(tmp_path: Path, measured: list) -> None:
    first = peak_flops(None, CPU, torch.float32, tmp_path)
    assert first > 0 and measured == [torch.float32]
    assert peak_flops(None, CPU, torch.float32, tmp_path) == first  # the next attempt: read, not measured
    assert measured == [torch.float32]
    peak_flops(None, CPU, torch.bfloat16, tmp_path)  # another dtype is another peak
    assert measured == [torch.float32, torch.bfloat16]
    assert len(json.loads((tmp_path / PEAK_FILE).read_text())) == 2


def test_a_configured_peak_wins_and_a_damaged_file_is_measured_again(tmp_path: Path, measured: list) -> None:
    assert peak_flops(1e12, CPU, torch.float32, tmp_path) == 1e12 and measured == []
    (tmp_path / PEAK_FILE).write_text('{"cut sh')  # a crash mid-write of an older version
    assert peak_flops(None, CPU, torch.float32, tmp_path) > 0 and measured == [torch.float32]
    assert len(json.loads((tmp_path / PEAK_FILE).read_text())) == 1
    assert peak_flops(None, CPU, torch.float32) > 0 and len(measured) == 2  # no run dir: measured


def test_each_ranks_throughput_and_the_stragglers_reach_tensorboard(tmp_path: Path) -> None:
    """Read back with TensorBoard's own event reader, as TensorBoard would show them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, start_step=0)
    writer.write({"step": 5, "loss": 7.0, "rank_tokens_per_s": [8000.0, 8000.0]})
    straggler = {"rank": 1, "node": 1, "host": "h", "ratio": 2.5}
    writer.write({"step": 10, "loss": 6.0, "rank_tokens_per_s": [8000.0, 3200.0], "stragglers": [straggler]})
    writer.write({"step": 10, "val_loss": 6.5})  # an evaluation's record: no per-rank numbers
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()

    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert scalars("rank_tokens_per_s/rank_1") == [(5, 8000.0), (10, 3200.0)]
    assert scalars("rank_tokens_per_s_spread") == [(5, 1.0), (10, 2.5)]
    assert scalars("stragglers") == [(5, 0.0), (10, 1.0)]
    assert scalars("straggler_ratio/rank_1") == [(10, 2.5)]
    assert scalars("loss") == [(5, 7.0), (10, 6.0)] and scalars("val_loss") == [(10, 6.5)]
