"""The collective preflight: real torchrun ranks over loopback, a wrong interface, a missing peer, their
reports (each rank into its own file of the directory GPTLAUNCH_REPORT_DIR names), and the pure
helpers the launcher imports (bandwidth formula, table)."""

from __future__ import annotations

import io
import socket
import sys
import time
from pathlib import Path

import pytest

from launcher.job import reports
from launcher.job.measurements import CollectiveError, CollectiveResult, SizeResult
from launcher.preflight.collective import _write_line, main
from launcher.preflight.collective_flags import DEFAULT_SIZES
from launcher.preflight.health import bus_bandwidth, format_table
from tests.integration.conftest import run

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
WORKER = ["-m", "launcher.preflight.collective"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sent(directory: Path) -> tuple[list[CollectiveResult], list[CollectiveError]]:
    """What the ranks reported into ``directory``: results (rank 0's) and errors (any rank's)."""
    done = [r.result for r in reports.read_dir(directory, reports.CollectiveDone)]
    return done, [r.error for r in reports.read_dir(directory, reports.CollectiveFailed)]


def test_two_local_ranks_over_loopback_report_every_size(tmp_path: Path) -> None:
    t0 = time.monotonic()
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", reports.REPORT_DIR_ENV: str(tmp_path)}
    proc = run([*TORCHRUN, *WORKER, "--iters", "3"], env=env)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,), errors = _sent(tmp_path)  # rank 0 only
    assert errors == [] and [p.name for p in tmp_path.iterdir()] == ["rank-0.jsonl"]
    assert (result.backend, result.world_size, result.iters) == ("gloo", 2, 3)
    assert result.ifname["GLOO_SOCKET_IFNAME"] == "lo"
    assert len(result.hosts) == 1
    assert [r.bytes for r in result.results] == list(DEFAULT_SIZES)
    for r in result.results:
        assert r.time_us > 0 and r.busbw_gbs > 0
        assert r.algbw_gbs == pytest.approx(r.bytes / (r.time_us * 1e-6) / 1e9, rel=1e-9)
        assert r.busbw_gbs == pytest.approx(r.algbw_gbs * 2 * (2 - 1) / 2, rel=1e-12)
    # The table for humans goes to stderr, one row per size.
    for size in DEFAULT_SIZES:
        assert any(line.split()[:1] == [str(size)] for line in proc.stderr.splitlines()), proc.stderr
    print(f"\n{format_table(result)}\nwhole torchrun run: {took:.1f} s")


def test_a_wrong_interface_fails_fast_naming_it(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = run(
        [*TORCHRUN, *WORKER, "--timeout-s", "10"],
        env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "nosuch0", reports.REPORT_DIR_ENV: str(tmp_path)},
        timeout=120,
    )
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert took < 60, f"took {took:.1f} s"
    results, errors = _sent(tmp_path)
    assert results == [] and errors, proc.stdout[-3000:] + proc.stderr[-3000:]
    for error in errors:
        assert error.phase == "init" and error.backend == "gloo"
        assert "GLOO_SOCKET_IFNAME=nosuch0" in error.message
        assert f"MASTER_ADDR:MASTER_PORT {error.master}" in error.message
    assert "nosuch0" in proc.stderr
    print(f"\nwrong interface: exit {proc.returncode} after {took:.1f} s: {errors[0].message}")


class _Recorder(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_a_line_for_people_is_one_write_so_ranks_sharing_a_pipe_cannot_glue_two() -> None:
    """Under PYTHONUNBUFFERED every write is its own syscall: ``print`` would send the newline apart
    and two ranks' lines could join into one."""
    stream = _Recorder()
    _write_line(stream, "error: x")
    assert stream.writes == ["error: x\n"]


def test_a_peer_that_never_comes_fails_within_the_timeout(tmp_path: Path) -> None:
    """Rank 0 of 2 alone (no torchrun): it waits for rank 1 at its own store, then gives up."""
    port = _free_port()
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", reports.REPORT_DIR_ENV: str(tmp_path)}
    t0 = time.monotonic()
    proc = run([sys.executable, *WORKER, "--timeout-s", "4"], env=env, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 1
    assert 4 <= took < 30, f"took {took:.1f} s"
    [], (error,) = _sent(tmp_path)
    assert error.phase == "init" and error.rank == 0
    assert f"127.0.0.1:{port}" in error.message and "(timeout 4 s)" in error.message
    print(f"\nmissing peer: exit {proc.returncode} after {took:.1f} s: {error.message}")


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The environment of rank 0 of 1, so ``main`` runs in this process; where it reports."""
    for key, value in {
        reports.REPORT_DIR_ENV: str(tmp_path / "reports"),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "GLOO_SOCKET_IFNAME": "lo",
    }.items():
        monkeypatch.setenv(key, value)
    return tmp_path / "reports"


def test_one_rank_in_process_reports_zero_bus_bandwidth_and_leaves_the_group(one_rank: Path) -> None:
    import torch.distributed as dist

    assert (
        main(["--backend", "gloo", "--sizes", "4,4096", "--iters", "2", "--warmup", "0", "--gpu-health"]) == 0
    )
    assert not dist.is_initialized()
    (result,), [] = _sent(one_rank)
    assert result.world_size == 1 and result.warmup == 0
    assert result.gpu_query == {}  # asked for, but a CPU rank has no GPU to query
    assert [(r.bytes, r.busbw_gbs) for r in result.results] == [(4, 0.0), (4096, 0.0)]
    assert all(r.algbw_gbs > 0 for r in result.results)


def test_a_wrong_sum_fails_with_an_error_report(one_rank: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist

    real = dist.all_reduce

    def corrupting(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        out = real(tensor, *args, **kwargs)  # type: ignore[arg-type]
        if tensor.dtype == torch.float32:  # the data, not the float64 time/count reduction
            tensor[-1] += 1
        return out

    monkeypatch.setattr(dist, "all_reduce", corrupting)
    assert main(["--backend", "gloo", "--sizes", "64", "--iters", "1"]) == 1
    assert not dist.is_initialized()
    [], (error,) = _sent(one_rank)
    assert error.phase == "check"
    assert "1 of 16 elements" in error.message and "expected 1" in error.message


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--sizes", "6"), ("--sizes", "0"), ("--sizes", "4,x"), ("--iters", "0"), ("--timeout-s", "0")],
)
def test_bad_arguments_are_refused(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("world_size", "busbw"),
    [(1, 0.0), (2, 2.0), (8, 2.0 * 2 * 7 / 8)],  # busbw = algbw * 2(n-1)/n, algbw = 1e9 B / 0.5 s
)
def test_bus_bandwidth_follows_nccl_tests(world_size: int, busbw: float) -> None:
    algbw, bus = bus_bandwidth(1_000_000_000, 0.5, world_size)
    assert algbw == pytest.approx(2.0, rel=1e-15)
    assert bus == pytest.approx(busbw, rel=1e-15)


@pytest.mark.parametrize(("size", "time_s", "n"), [(4, 0.0, 2), (4, 1.0, 0), (-4, 1.0, 2)])
def test_bus_bandwidth_refuses_impossible_input(size: int, time_s: float, n: int) -> None:
    with pytest.raises(ValueError):
        bus_bandwidth(size, time_s, n)


def _result(**changes: object) -> CollectiveResult:
    fields: dict[str, object] = {
        "backend": "gloo",
        "world_size": 2,
        "hosts": ["a"],
        "ifname": {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": None},
        "master": "10.0.0.1:29500",
        "torch": "2.13.0",
        "iters": 5,
        "warmup": 2,
        "init_s": 0.25,
        "results": [
            SizeResult(bytes=4, time_us=50.0, algbw_gbs=8e-5, busbw_gbs=8e-5),
            SizeResult(bytes=33554432, time_us=25000.0, algbw_gbs=1.342, busbw_gbs=1.342),
        ],
    }
    return CollectiveResult.model_validate(fields | changes)


def test_format_table_has_a_row_per_size_with_units() -> None:
    lines = format_table(_result()).splitlines()
    assert "gloo" in lines[0] and "GLOO_SOCKET_IFNAME=eth0" in lines[0] and "2 rank(s)" in lines[0]
    assert lines[1].split() == ["size", "(B)", "time", "(µs)", "algbw", "(GB/s)", "busbw", "(GB/s)"]
    assert [line.split() for line in lines[2:]] == [
        ["4", "50.0", "0.000", "0.000"],
        ["33554432", "25000.0", "1.342", "1.342"],
    ]


def test_importing_the_module_does_not_import_torch() -> None:
    code = (
        "import sys, launcher.preflight.collective; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    proc = run([sys.executable, "-c", code], check=True)
    assert proc.stdout.strip() == "[]"
