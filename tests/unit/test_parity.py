"""Version parity: the per-host probe (on this machine, for real) and the comparison of probes."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gptlaunch.contract import EXIT_FAILED, EXIT_REFUSED
from launcher.job import reports
from launcher.job.measurements import Gpu, Probe
from launcher.preflight import parity_step
from launcher.preflight import probe as probe_module
from launcher.preflight.parity import (
    MAX_RUNS,
    MUST_MATCH,
    Mismatch,
    Shortfall,
    compare,
    diff_text,
    host_ranges,
    report_table,
)
from launcher.preflight.probe import KEY_PACKAGES, collect

REPO_ROOT = Path(__file__).resolve().parents[2]
A100 = Gpu(index=0, name="NVIDIA A100 80GB", memory_bytes=80 * 2**30)


def make_probe(**overrides: Any) -> Probe:
    """A plausible GPU host's report; ``overrides`` replace fields (``packages`` entries are merged)."""
    packages = {"numpy": "2.4.6", "tokenizers": "0.23.3", "datasets": "5.2.0", "triton": "3.4.0"}
    packages["nvidia-nccl-cu12"] = "2.21.5"
    fields: dict[str, Any] = {
        "hostname": "gl-h1",
        "os": "Ubuntu 22.04.4 LTS",
        "kernel": "5.15.0-105-generic",
        "machine": "x86_64",
        "python": "3.11.7",
        "python_executable": "/opt/venv/bin/python",
        "torch": "2.13.0",
        "torch_git": "cf30153c4c131c8164ee7798e5022d810682e2cb",
        "cuda": "12.4",
        "nccl": "2.21.5",
        "cudnn": "9.1.0",
        "driver": "550.54.14",
        "gpus": [A100.model_copy(update={"index": i}) for i in range(8)],
        "launcher": "0.1.0",
        "packages": packages | overrides.pop("packages", {}),
        "image_digest": None,
        "in_container": False,
        "interfaces": {"lo": ["127.0.0.1"], "eth0": ["10.0.0.1"]},
        "route": None,
        "resolved": {},
        "free_port": None,
        "probe_s": 1.5,
    }
    return Probe(**(fields | overrides))


def two_hosts(**second: Any) -> dict[str, Probe]:
    return {"gl-h1": make_probe(), "gl-h2": make_probe(hostname="gl-h2", **second)}


def test_equal_reports_match_although_informational_fields_differ() -> None:
    probes = two_hosts(kernel="6.8.0", driver="555.42.02", os="Rocky Linux 9.4", interfaces={"lo": []})
    assert compare(probes, gpus_per_node=8) == ([], [])


def test_a_different_package_is_one_mismatch_naming_versions_and_hosts() -> None:
    mismatches, shortfalls = compare(two_hosts(packages={"tokenizers": "0.20.1"}), gpus_per_node=8)
    assert shortfalls == []
    assert [m.field for m in mismatches] == ["packages.tokenizers"]
    assert mismatches[0].values == {"gl-h1": "0.23.3", "gl-h2": "0.20.1"}
    assert mismatches[0].describe() == "packages.tokenizers: 0.23.3 on gl-h1; 0.20.1 on gl-h2"


def test_a_missing_package_is_shown_as_not_installed() -> None:
    mismatches, _ = compare(two_hosts(packages={"triton": None}), gpus_per_node=8)
    assert [m.field for m in mismatches] == ["packages.triton"]
    assert "(not installed) on gl-h2" in mismatches[0].describe()


def test_describe_puts_the_majority_value_first_and_groups_its_hosts() -> None:
    values = {"h1": "2.12.0", "h2": "2.13.0", "h3": "2.13.0"}
    assert Mismatch("torch", values).describe() == "torch: 2.13.0 on h2, h3; 2.12.0 on h1"
    many = {f"h{i}": "2.13.0" for i in range(10)} | {"odd": None}
    assert Mismatch("torch", many).describe() == "torch: 2.13.0 on h0..h9; (not installed) on odd"


def test_host_ranges_compress_runs_of_numbered_names() -> None:
    hosts = [f"gl-h{k}" for k in range(1, 17) if k != 13]
    assert host_ranges(hosts) == "gl-h1..gl-h12, gl-h14..gl-h16"
    assert host_ranges(["n08", "n09", "n10", "x", "n11"]) == "n08..n10, x, n11"
    assert host_ranges(["a", "b"]) == "a, b"
    scattered = [f"h{k}" for k in range(0, 40, 2)]  # 20 runs of one
    assert host_ranges(scattered) == ", ".join(scattered[:MAX_RUNS]) + f", … and {20 - MAX_RUNS} more host(s)"


def test_every_must_match_field_is_enforced() -> None:
    overrides: dict[str, Any] = {
        "python": "3.11.9",
        "torch": "2.12.0",
        "torch_git": "0" * 40,
        "cuda": "12.1",
        "nccl": "2.20.5",
        "cudnn": "8.9.2",
        "launcher": "0.2.0",
        "image_digest": "sha256:" + "a" * 64,
        "packages": {name: "0.0.1" for name in KEY_PACKAGES},
    }
    mismatches, _ = compare(two_hosts(**overrides), gpus_per_node=8)
    assert tuple(m.field for m in mismatches) == MUST_MATCH


def test_cpu_only_hosts_pass_the_gpu_requirement() -> None:
    probes = {h: make_probe(hostname=h, gpus=[]) for h in ("c1", "c2")}
    assert compare(probes, gpus_per_node=4) == ([], [])


def test_a_host_with_too_few_gpus_falls_short_when_any_host_has_gpus() -> None:
    probes = {"gl-h1": make_probe(), "gl-h2": make_probe(gpus=[A100] * 4), "gl-h3": make_probe(gpus=[])}
    mismatches, shortfalls = compare(probes, gpus_per_node=8)
    assert mismatches == []
    assert shortfalls == [Shortfall("gl-h2", 8, 4), Shortfall("gl-h3", 8, 0)]
    assert compare(probes, gpus_per_node=4)[1] == [Shortfall("gl-h3", 4, 0)]


def test_diff_text_has_header_each_difference_and_the_fix() -> None:
    mismatches, shortfalls = compare(two_hosts(torch="2.12.0", gpus=[A100]), gpus_per_node=8)
    lines = diff_text(mismatches, shortfalls).splitlines()
    assert (
        lines[0] == "version parity check failed: 1 field(s) differ across hosts; 1 host(s) have too few GPUs"
    )
    assert lines[1] == "  torch: 2.13.0 on gl-h1; 2.12.0 on gl-h2"
    assert lines[2] == "  gpus: gl-h2 has 1, the job runs 8 process(es) per node"
    assert "install the same versions on every host" in lines[3]
    assert lines[3].endswith("--skip-parity launches anyway")


def test_report_table_marks_the_rows_that_differ() -> None:
    table = report_table(two_hosts(packages={"tokenizers": "0.20.1"}, driver="555.42.02"))
    rows = {line.split()[1] if line[0] in "!~" else line.split()[0]: line for line in table.splitlines()}
    assert rows["field"].split() == ["field", "gl-h1", "gl-h2"]
    assert rows["packages.tokenizers"].startswith("! packages.tokenizers")
    assert rows["packages.tokenizers"].split()[-2:] == ["0.23.3", "0.20.1"]
    assert rows["driver"].startswith("~ driver")
    assert rows["hostname"].startswith("  hostname")  # differs by definition: never marked
    assert rows["torch"].startswith("  torch")
    assert rows["gpus"].split() == ["gpus", *["8", "×", "NVIDIA", "A100", "80GB"] * 2]


def test_many_identical_hosts_are_one_line() -> None:
    probes = {f"gl-h{k}": make_probe(hostname=f"gl-h{k}") for k in range(1, 17)}
    (line,) = report_table(probes).splitlines()
    assert line.startswith("16 host(s) gl-h1..gl-h16 alike: os ")
    assert "torch 2.13.0" in line and "python 3.11.7" in line


def test_many_hosts_that_differ_are_grouped_by_the_values_of_the_differing_fields() -> None:
    probes = {f"gl-h{k}": make_probe(hostname=f"gl-h{k}") for k in range(1, 17)}
    probes["gl-h13"] = make_probe(hostname="gl-h13", torch="2.12.0", driver="555.42.02")
    lines = report_table(probes).splitlines()
    assert lines[0].startswith("16 host(s) gl-h1..gl-h16 alike in: os ") and "torch " not in lines[0]
    assert "! torch: 2.13.0 on gl-h1..gl-h12, gl-h14..gl-h16; 2.12.0 on gl-h13" in lines
    assert any(line.startswith("~ driver: ") and line.endswith("555.42.02 on gl-h13") for line in lines)


def test_nccl_and_cudnn_versions_are_formatted_from_what_torch_returns() -> None:
    cuda_build = SimpleNamespace(
        distributed=SimpleNamespace(is_available=lambda: True, is_nccl_available=lambda: True),
        cuda=SimpleNamespace(nccl=SimpleNamespace(version=lambda: (2, 21, 5))),
        backends=SimpleNamespace(cudnn=SimpleNamespace(is_available=lambda: True, version=lambda: 90100)),
    )
    assert probe_module._nccl_version(cuda_build) == "2.21.5"
    assert probe_module._cudnn_version(cuda_build) == "9.1.0"
    cuda_build.backends.cudnn.version = lambda: 8902  # cuDNN 8 encodes major * 1000
    assert probe_module._cudnn_version(cuda_build) == "8.9.2"
    cuda_build.cuda.nccl.version = lambda: 1 / 0  # a broken library reports no NCCL, not a crash
    assert probe_module._nccl_version(cuda_build) is None


@pytest.fixture(scope="module")
def here() -> Probe:
    return collect(route_to="127.0.0.1", resolve=["localhost", "no-such-host.invalid"], free_port=True)


def test_collect_reports_this_machine(here: Probe) -> None:
    import torch

    assert here.python == platform.python_version()
    assert here.torch == torch.__version__
    assert here.torch_git == torch.version.git_version
    assert here.cuda == torch.version.cuda
    assert len(here.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert set(here.packages) == set(probe_module.KEY_PACKAGES)
    assert here.packages["tokenizers"] is not None and here.packages["tokenizers"][0].isdigit()
    assert "127.0.0.1" in here.interfaces["lo"]
    assert 0 < here.probe_s < 120


def test_collect_finds_routes_names_and_a_free_port(here: Probe) -> None:
    assert here.route is not None
    assert (here.route.to, here.route.address, here.route.dev) == ("127.0.0.1", "127.0.0.1", "lo")
    assert here.resolved["localhost"] in ("127.0.0.1", "::1")
    assert here.resolved["no-such-host.invalid"] is None
    assert isinstance(here.free_port, int) and 1 <= here.free_port <= 65535


def test_an_unresolvable_route_target_gives_no_route() -> None:
    probe = collect(route_to="no-such-host.invalid")
    assert probe.route is None
    assert probe.resolved == {"no-such-host.invalid": None}
    assert probe.free_port is None


def test_route_falls_back_to_the_kernels_choice_without_iproute2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe_module, "_run", lambda argv: None)  # as if `ip` were missing
    route = probe_module.find_route("localhost", "127.0.0.1")
    assert route is not None and (route.dev, route.src) == ("lo", "127.0.0.1")


def test_readable_listing(capsys: pytest.CaptureFixture[str]) -> None:
    assert probe_module.main(["--route-to", "127.0.0.1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"python_executable: {sys.executable}" in [" ".join(line.split()) for line in lines]
    assert any(line.startswith("route:") and line.endswith("dev lo src 127.0.0.1") for line in lines)


def test_json_from_the_command_line_is_a_valid_probe() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.preflight.probe",
            "--json",
            "--free-port",
            "--resolve",
            "nope.invalid",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 1
    probe = Probe.model_validate_json(done.stdout)
    assert probe.python == platform.python_version()
    assert probe.resolved == {"nope.invalid": None}
    assert isinstance(json.loads(done.stdout)["free_port"], int)


def test_importing_probe_and_parity_imports_no_torch() -> None:
    code = (
        "import sys, launcher.preflight.probe, launcher.preflight.parity; "
        "heavy = {'torch', 'numpy', 'tokenizers'} & set(sys.modules); assert not heavy, heavy"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def _write_reports(job_dir: Path, *probes: Probe) -> None:
    """The parity step's srun output: one report per node, after whatever the node printed first."""
    (job_dir / parity_step.PROBE_DIR).mkdir(parents=True)
    for node, probe in enumerate(probes):
        report = job_dir / parity_step.PROBE_DIR / f"node-{node}.json"
        report.write_text(f"a banner line\n{probe.model_dump_json()}\n")


def test_the_slurm_parity_step_goes_on_when_the_nodes_match(tmp_path: Path) -> None:
    _write_reports(tmp_path, make_probe(), make_probe(hostname="gl-h2", kernel="6.8.0"))
    assert parity_step.main(["--job-dir", str(tmp_path), "--nodes", "2", "--gpus-per-node", "8"]) == 0
    assert not reports.read(tmp_path, reports.Refused)


def test_the_slurm_parity_step_ends_the_job_with_the_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_reports(tmp_path, make_probe(), make_probe(hostname="gl-h2", packages={"tokenizers": "0.20.3"}))
    before = time.time()
    assert parity_step.main(["--job-dir", str(tmp_path), "--nodes", "2"]) == EXIT_REFUSED
    (failure,) = reports.read(tmp_path, reports.Refused, before)
    assert (failure.exit_code, failure.check) == (EXIT_REFUSED, "parity")
    assert "packages.tokenizers: 0.23.3 on gl-h1 (node 0); 0.20.3 on gl-h2 (node 1)" in failure.message
    assert failure.message in capsys.readouterr().err
    assert not reports.read(tmp_path, reports.Refused, failure.time + 1)  # an earlier run's is not this one's


def test_the_slurm_parity_step_checks_gpus_and_skip_parity_only_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_reports(tmp_path, make_probe(), make_probe(hostname="gl-h2", gpus=[A100]))
    args = ["--job-dir", str(tmp_path), "--nodes", "2", "--gpus-per-node", "8"]
    assert parity_step.main(args) == EXIT_REFUSED
    assert "gpus: gl-h2 (node 1) has 1" in capsys.readouterr().err
    since = time.time()
    assert parity_step.main([*args, "--skip-parity"]) == 0
    assert "WARNING (--skip-parity" in capsys.readouterr().err
    assert not reports.read(tmp_path, reports.Refused, since)


def test_the_slurm_parity_step_names_a_node_without_a_report(tmp_path: Path) -> None:
    _write_reports(tmp_path, make_probe())
    assert parity_step.main(["--job-dir", str(tmp_path), "--nodes", "2"]) == EXIT_FAILED
    (failure,) = reports.read(tmp_path, reports.Refused)
    assert "node 1: no probe report" in failure.message
    assert "node 0" not in failure.message and "parity/node-1.log" in failure.message


def test_a_probe_recorded_on_an_h200_reads_and_a_host_with_another_torch_is_named() -> None:
    """``tests/fixtures/probe/h200.json``: ``launcher probe --json`` on a real H200 machine."""
    h200 = Probe.model_validate_json((REPO_ROOT / "tests/fixtures/probe/h200.json").read_text())
    assert [g.name for g in h200.gpus] == ["NVIDIA H200"] and h200.gpus[0].memory_bytes > 140e9
    assert (h200.cuda, h200.nccl, h200.driver) == ("13.0", "2.28.9", "580.159.04")
    other = h200.model_copy(update={"hostname": "other", "torch": "2.13.0+cu130"})
    mismatches, shortfalls = compare({"a": h200, "b": other}, gpus_per_node=1)
    assert [m.field for m in mismatches] == ["torch"] and shortfalls == []
