"""The health gate's verdict (``launcher.preflight.health``): the pair schedule, which host a slow
link or a slow device names, and the lines a user reads."""

from __future__ import annotations

import pytest

from launcher.job.measurements import DeviceResult, PairResult
from launcher.job.torchrun import trainer_flag
from launcher.preflight.health import (
    PAIR_BYTES,
    GateSettings,
    compute_findings,
    link_findings,
    pair_rounds,
    report_text,
)

HOSTS = [f"gl-h{k}" for k in range(1, 9)]


@pytest.mark.parametrize("n", range(2, 41))
def test_pair_rounds_are_disjoint_pairs_covering_the_ring_in_at_most_three_rounds(n: int) -> None:
    rounds = pair_rounds(n)
    assert len(rounds) == (1 if n == 2 else 2 if n % 2 == 0 else 3)
    for pairs in rounds:
        hosts = [h for pair in pairs for h in pair]
        assert len(hosts) == len(set(hosts)), f"a host twice in one round: {pairs}"
    edges = {frozenset(pair) for pairs in rounds for pair in pairs}
    ring = {frozenset((i, (i + 1) % n)) for i in range(n)}
    assert edges == ring
    for host in range(n):  # every host meets two others (its one partner when n = 2)
        assert sum(host in pair for pairs in rounds for pair in pairs) == min(2, n - 1)


def test_fewer_than_two_hosts_have_no_pairs() -> None:
    assert pair_rounds(0) == [] and pair_rounds(1) == []


def _pairs(n: int, busbw: dict[frozenset[int], float], default: float = 0.6) -> list[PairResult]:
    return [
        PairResult(
            round=r, nodes=pair, bytes=4 << 20, time_us=1.0, busbw_gbs=busbw.get(frozenset(pair), default)
        )
        for r, pairs in enumerate(pair_rounds(n))
        for pair in pairs
    ]


def test_the_host_whose_two_pairs_are_slow_is_named_and_its_partners_are_not() -> None:
    slow = {frozenset((1, 2)): 0.04, frozenset((2, 3)): 0.05}  # gl-h3's two links
    pairs = _pairs(8, slow)
    (found,) = link_findings(pairs, HOSTS, {"gl-h3": "eth0"}, None)
    assert (found.host, found.check, found.figure) == ("gl-h3", "link", 0.05)
    assert found.line.startswith("gl-h3: link 0.05 GB/s on eth0, below half the median 0.6 GB/s (pairs ")
    assert "gl-h2-gl-h3 0.04" in found.line and "gl-h3-gl-h4 0.05" in found.line


@pytest.mark.parametrize("n", range(3, 17))
def test_one_slow_host_is_named_for_any_count_from_three(n: int) -> None:
    """With three hosts two of the three pairs hold the slow host: a median over pairs would be slow
    too, so the median is over each host's best pair."""
    hosts = [f"gl-h{k}" for k in range(1, n + 1)]
    slow = {frozenset((0, 1)): 0.04, frozenset((1, 2)): 0.04}  # gl-h2's two links
    assert [f.host for f in link_findings(_pairs(n, slow), hosts, {}, None)] == ["gl-h2"]


def test_one_slow_pair_names_nobody_the_fault_could_be_either_end() -> None:
    assert link_findings(_pairs(8, {frozenset((1, 2)): 0.04}), HOSTS, {}, None) == []


def test_healthy_noise_within_half_the_median_names_nobody() -> None:
    noisy = {frozenset((i, (i + 1) % 8)): 0.31 + 0.05 * i for i in range(8)}  # 0.31..0.66, median 0.485
    assert link_findings(_pairs(8, noisy), HOSTS, {}, None) == []


def test_min_busbw_names_hosts_whose_pairs_are_all_below_it_even_when_the_median_is_as_low() -> None:
    pairs = _pairs(4, {}, default=0.6)
    named = link_findings(pairs, HOSTS[:4], {}, 5.0)
    assert [f.host for f in named] == HOSTS[:4]
    assert "below --min-busbw 5 GB/s" in named[0].line
    assert link_findings(pairs, HOSTS[:4], {}, 0.1) == []


def test_two_hosts_name_nobody_by_the_median_alone() -> None:
    assert link_findings(_pairs(2, {}, default=0.01), HOSTS[:2], {}, None) == []


def _device(rank: int, tflops: float, kind: str = "cpu") -> DeviceResult:
    return DeviceResult(
        rank=rank, node=rank, local_rank=0, device="cpu", kind=kind, dtype="bfloat16", size=512, tflops=tflops
    )


def test_a_device_below_0_8_of_its_kinds_median_is_named() -> None:
    devices = [_device(0, 0.150), _device(1, 0.156), _device(2, 0.066), _device(3, 0.154)]
    (found,) = compute_findings(devices, HOSTS)
    assert found.host == "gl-h3" and found.check == "compute"
    assert found.line == (
        "gl-h3: compute 0.066 TFLOP/s on cpu (rank 2, bfloat16), below 0.8 × the median 0.152 TFLOP/s "
        "of 4 cpu device(s)"
    )


def test_devices_are_compared_within_their_kind_and_dtype_only() -> None:
    fp32 = DeviceResult(
        rank=3, node=3, local_rank=0, device="cpu", kind="cpu", dtype="float32", size=512, tflops=0.05
    )  # a CPU without native bf16: slower, but not compared with the bf16 ones
    assert compute_findings([_device(0, 0.15), _device(1, 0.15), _device(2, 0.15), fp32], HOSTS) == []


def test_devices_are_compared_within_their_kind_only() -> None:
    devices = [
        _device(0, 700, "H100"),
        _device(1, 690, "H100"),
        _device(2, 300, "A100"),
        _device(3, 310, "A100"),
    ]
    assert compute_findings(devices, HOSTS) == []
    assert compute_findings([*devices[:2], _device(2, 500, "H100")], HOSTS)[0].host == "gl-h3"


def test_the_report_says_when_nobody_is_named() -> None:
    from launcher.job.measurements import CollectiveResult

    result = CollectiveResult(
        backend="gloo", world_size=4, hosts=HOSTS[:4], ifname={}, master="gl-h1:1", torch="2.13.0", iters=5,
        warmup=2, init_s=0.1, results=[], pairs=_pairs(4, {}), compute=[_device(r, 0.15) for r in range(4)],
    )  # fmt: skip
    text = report_text(result, HOSTS[:4], [])
    assert "4 pair(s) in 2 round(s):" in text and "gl-h4-gl-h1" in text
    assert text.endswith("health gate: no host named (4 host(s); links, compute checked)")
    again = result.model_copy(update={"pairs": [p.model_copy(update={"passes": 2}) for p in result.pairs]})
    assert "4 pair(s) in 2 round(s), each pair's better of 2 passes:" in report_text(again, HOSTS[:4], [])


def test_gate_settings_render_the_workers_flags() -> None:
    gate = GateSettings(compute_s=0.5, precision="fp32", gpus_per_node=2)
    argv = gate.worker_argv(3, 1, ("gl-h1", 29500), 60)
    assert argv == [
        "-m", "torch.distributed.run", "--nnodes=3", "--nproc-per-node=2", "--node-rank=1",
        "--master-addr=gl-h1", "--master-port=29500", "-m", "launcher.preflight.collective", "--timeout-s=60",
        "--compute-s=0.5", "--precision=fp32", f"--pair-bytes={PAIR_BYTES}", "--gpu-health",
    ]  # fmt: skip
    assert GateSettings(min_busbw=2.5).worker_argv(1, 0, ("h", 1), 1)[-1] == "--min-busbw=2.5"


def test_trainer_flag_takes_the_last_value_in_either_spelling() -> None:
    assert trainer_flag(["--precision", "fp32", "--precision=bf16"], "--precision") == "bf16"
    assert trainer_flag(["--precision=bf16", "--precision", "fp32"], "--precision") == "fp32"
    assert trainer_flag(["--precision-x", "y"], "--precision") is None
