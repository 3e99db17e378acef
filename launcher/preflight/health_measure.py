"""The measuring half of the health gate (the verdict is ``launcher.preflight.health``'s), run by every
rank of the collective preflight (``launcher.preflight.collective --compute-s S --pair-bytes B``):

- ``measure_compute``: dense n×n matmuls in the job's dtype on this rank's device for ``seconds``,
  started together on every rank (a barrier), so ranks that share a machine share it alike;
- ``measure_pairs``: the pairwise stage, an all_reduce among the ranks of each pair of hosts of
  ``launcher.preflight.health.pair_rounds``, the pairs of a round at the same time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar, cast

from launcher.job.measurements import DeviceResult, PairResult
from launcher.preflight.health import bus_bandwidth, link_findings, pair_rounds

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

# n of the n×n matmuls: big enough to reach a GPU's peak (8192: 1.1 TFLOP each, ~2 ms on an H100),
# small enough on a CPU (512: 0.27 GFLOP, a few ms on one core) that a slow device still finishes
# several within the window.
MATMUL_N = {"cuda": 8192, "cpu": 512}
WARMUP_MATMULS = 2  # cuBLAS/oneDNN set-up and GPU clocks ramping
PAIR_CALLS = 10  # timed all_reduce calls per pair, at least: their median is the pair's figure

T = TypeVar("T")


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype the trainer computes in for ``--precision`` on ``device`` (the rule of
    ``trainer.run._precision``): bf16 where the device has it natively, fp16 on a GPU without bf16,
    fp32 on a CPU without native bf16/fp16 kernels (oneDNN's reference path is ~200x slower)."""
    import torch

    if precision == "fp32":
        return torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    if precision == "bf16" and torch.cuda.is_bf16_supported(False):
        return torch.bfloat16
    return torch.float16


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits until the device has finished its queued work: CUDA calls return before the work is
    done (gloo's and the CPU's calls return when done)."""
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def all_gather(value: T) -> list[T]:
    """``value`` of every rank of the default group, in rank order. Collective."""
    import torch.distributed as dist

    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return cast("list[T]", gathered)


def measure_compute(
    rank: int, node: int, local_rank: int, device: torch.device, precision: str, seconds: float
) -> DeviceResult:
    """Matmuls on ``device`` until ``seconds`` have passed (at least one), timed after a barrier.
    Collective (the barrier): every rank of the default group must call it."""
    import torch
    import torch.distributed as dist

    dtype = compute_dtype(precision, device)
    n = MATMUL_N[device.type]
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # One core per CPU process, as torchrun gives each (OMP_NUM_THREADS=1): a figure per core
        # compares hosts of any size and does not depend on how many processes share the cores.
        torch.set_num_threads(1)
    try:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        sync = synchronizer(device)
        for _ in range(WARMUP_MATMULS):
            torch.mm(a, b)
        sync()
        # Every device starts together: hosts sharing a machine (or a switch) share it alike.
        dist.barrier()
        count, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            count += 1
            if device.type == "cuda" and count % 16:
                continue  # look at the clock (a synchronization) only every 16 queued matmuls
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    finally:
        torch.set_num_threads(threads)
    tflops = 2 * n**3 * count / elapsed / 1e12  # an n×n by n×n matmul is 2n³ floating-point operations
    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    where = f"cuda:{device.index}" if device.type == "cuda" else "cpu"
    return DeviceResult(
        rank=rank, node=node, local_rank=local_rank, device=where, kind=kind,
        dtype=str(dtype).removeprefix("torch."), size=n, tflops=tflops,
    )  # fmt: skip


def measure_pairs(
    node_of_rank: list[int],
    device: torch.device,
    size_bytes: int,
    iters: int,
    warmup: int,
    timeout_s: float,
    min_busbw: float | None = None,
) -> list[PairResult]:
    """Every pair of every round of ``pair_rounds`` over the nodes of ``node_of_rank`` (each rank's
    node rank): the slower rank's median time per all_reduce of ``size_bytes`` among the pair's
    ranks; each group's creation is bounded by ``timeout_s``. When that would name a host
    (``link_findings`` with ``min_busbw``), every pair is measured once more and keeps its better
    pass: a slow link is slow both times, a busy moment is not.
    Collective: every rank of the default group calls it. Every pair's result on every rank, in
    round order."""
    first = _pairs_pass(node_of_rank, device, size_bytes, iters, warmup, timeout_s)
    nodes = [str(n) for n in range(max(node_of_rank) + 1)]
    if not link_findings(first, nodes, {}, min_busbw):
        return first
    second = _pairs_pass(node_of_rank, device, size_bytes, iters, warmup, timeout_s)
    return [
        max(a, b, key=lambda p: p.busbw_gbs).model_copy(update={"passes": 2})
        for a, b in zip(first, second, strict=True)
    ]


def _pairs_pass(
    node_of_rank: list[int], device: torch.device, size_bytes: int, iters: int, warmup: int, timeout_s: float
) -> list[PairResult]:
    """One pass of ``measure_pairs``: every round once. Collective."""
    import torch.distributed as dist

    nodes = sorted(set(node_of_rank))
    mine: list[PairResult] = []
    for number, pairs in enumerate(pair_rounds(len(nodes))):
        members = [
            [r for r, node in enumerate(node_of_rank) if node in (nodes[a], nodes[b])] for a, b in pairs
        ]
        # Every rank creates every pair's group (a global new_group). Local synchronization, where
        # only the pair's ranks would, hangs gloo's second group of a rank (torch 2.13, seen here).
        group, _ = dist.new_subgroups_by_enumeration(members, timeout=timedelta(seconds=timeout_s))
        if group is None:
            continue  # this rank's host sits this round out (an odd count)
        pair = next(p for p, m in zip(pairs, members, strict=True) if dist.get_rank() in m)
        pair_nodes = (nodes[pair[0]], nodes[pair[1]])
        time_s = _time_all_reduce(group, device, size_bytes, max(iters, PAIR_CALLS), warmup)
        _, busbw = bus_bandwidth(size_bytes, time_s, dist.get_world_size(group))
        us = time_s * 1e6
        mine.append(PairResult(round=number, nodes=pair_nodes, bytes=size_bytes, time_us=us, busbw_gbs=busbw))
    unique = {(p.round, p.nodes): p for results in all_gather(mine) for p in results}
    return [unique[key] for key in sorted(unique)]


def _time_all_reduce(
    group: dist.ProcessGroup, device: torch.device, size_bytes: int, calls: int, warmup: int
) -> float:
    """Median seconds per all_reduce of ``size_bytes`` within ``group`` over ``calls`` calls, the
    slowest member's. The median, not the mean: a link that is slow is slow on every call, while a
    busy CPU or switch delays a few calls, which must not name a host."""
    import torch
    import torch.distributed as dist

    sync = synchronizer(device)
    data = torch.zeros(size_bytes // 4, dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(data, group=group)
    sync()
    dist.barrier(group=group)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        dist.all_reduce(data, group=group)
        sync()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())
