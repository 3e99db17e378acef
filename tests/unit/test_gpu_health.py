"""GPU health from ``nvidia-smi --query-gpu`` CSV (``launcher.preflight.gpu_health``) and the lines the
health gate prints for it (``launcher.preflight.health.gpu_findings``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from launcher.preflight import gpu_health
from launcher.preflight.health import gpu_findings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.csv")), ids=lambda p: p.name)
def test_every_output_parses_into_one_row_per_gpu_with_every_field(path: Path) -> None:
    rows = gpu_health.parse(path.read_text())
    assert rows and [row["index"] for row in rows] == [str(i) for i in range(len(rows))]
    assert all(set(gpu_health.FIELDS) <= set(row) for row in rows)  # legacy names read as today's


def test_a_healthy_host_passes() -> None:
    rows = gpu_health.parse((FIXTURES / "format-8xH100-healthy.csv").read_text())
    assert gpu_health.judge(rows, gpus_per_node=8) == []


def test_a_recorded_h200_passes() -> None:
    rows = gpu_health.parse((FIXTURES / "h200.csv").read_text())  # recorded on a real H200
    assert [row["name"] for row in rows] == ["NVIDIA H200"]
    assert gpu_health.judge(rows, gpus_per_node=1) == []


def test_ecc_errors_a_pending_remap_and_a_thermal_slowdown_are_named_with_their_field() -> None:
    text = (FIXTURES / "format-8xH100-ecc-error.csv").read_text()
    lines = [f.line for f in gpu_findings({1: text}, ["gl-h1", "gl-h2"], 8)]
    assert lines == [
        "gl-h2: gpu 3 ecc.errors.uncorrected.volatile.total 2: uncorrectable memory errors",
        "gl-h2: gpu 3 remapped_rows.pending Yes: a row remap waits for a GPU reset",
        "gl-h2: gpu 5 clocks_event_reasons.active 0x0000000000000048: hardware slowdown, "
        "hardware thermal slowdown",
    ]


def test_legacy_names_heat_and_persistence_mode_and_too_few_gpus() -> None:
    text = (FIXTURES / "format-2xV100-legacy-hot.csv").read_text()
    found = gpu_findings({0: text}, ["gl-h1"], 4)
    fatal = [f.line for f in found if f.fatal]
    assert fatal == [
        "gl-h1: gpu 0 temperature.gpu 88 C: at or above 85 C",
        "gl-h1: gpus: count 2: the job runs 4 process(es) per node",
    ]  # 0x4 (software power cap) is normal under load: not named
    warnings = [f.line for f in found if not f.fatal]
    assert len(warnings) == 2 and all("persistence_mode Disabled" in w for w in warnings)


def test_two_gpu_models_on_one_host_are_named() -> None:
    text = (
        (FIXTURES / "format-8xH100-healthy.csv")
        .read_text()
        .replace("7, NVIDIA H100 80GB HBM3", "7, NVIDIA A100-SXM4-80GB")
    )
    ((line, fatal),) = gpu_health.judge(gpu_health.parse(text), 8)
    why = "more than one GPU model on the host"
    assert fatal and line == f"gpus: name NVIDIA A100-SXM4-80GB / NVIDIA H100 80GB HBM3: {why}"


def test_a_failed_query_names_the_host_with_what_it_printed() -> None:
    (finding,) = gpu_findings({0: "error: nvidia-smi --query-gpu: NVIDIA-SMI has failed"}, ["gl-h1"], 1)
    assert finding.fatal and finding.line.startswith("gl-h1: gpu health unknown: not nvidia-smi")
    assert "NVIDIA-SMI has failed" in finding.line


def test_query_without_nvidia_smi_is_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_health.query() is None


def test_query_retries_with_the_legacy_field_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A driver before 535 refuses clocks_event_reasons.*: the query is asked again with the old name."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in *clocks_event_reasons*) echo \'Field "clocks_event_reasons.active" is not a valid '
        "field to query.'; exit 2;; esac\n"
        f'echo "index, clocks_throttle_reasons.active"; echo "0, 0x0"; echo "$1" > {tmp_path}/asked\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    text = gpu_health.query()
    assert text is not None and gpu_health.parse(text) == [
        {"index": "0", "clocks_event_reasons.active": "0x0"}
    ]
    assert "clocks_throttle_reasons.active" in (tmp_path / "asked").read_text()
