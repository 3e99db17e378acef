"""What the collective preflight reports, read by the launcher without importing torch: the
``GPTLAUNCH_COLLECTIVE`` result line and the ``GPTLAUNCH_COLLECTIVE_ERROR`` line a failing rank prints
(``launcher.preflight.collective``), how to find them in mixed torchrun output, the bandwidth formula
and the table for humans.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md): algbw = size / time; busbw = algbw * 2(n-1)/n for
all_reduce, which is the bandwidth each link needs and so comparable with the hardware's peak,
whatever the number of ranks n. Units: GB/s = 1e9 bytes/s, time in microseconds per call, the slowest
rank's (as nccl-tests reports).
"""

from __future__ import annotations

import re
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

MARKER = "GPTLAUNCH_COLLECTIVE"
ERROR_MARKER = "GPTLAUNCH_COLLECTIVE_ERROR"

Phase = Literal["init", "collective", "check", "compute"]


class _Line(BaseModel):
    # Unknown fields are ignored: a launcher older than the workers still reads their lines.
    model_config = ConfigDict(extra="ignore", frozen=True)


class SizeResult(_Line):
    """One message size: the slowest rank's time per all_reduce call and the bandwidths it gives."""

    bytes: int  # size of the float32 tensor, bytes
    time_us: float  # microseconds per call, max over ranks
    algbw_gbs: float  # bytes / time, GB/s (1e9 bytes/s)
    busbw_gbs: float  # algbw * 2(n-1)/n, GB/s


class PairResult(_Line):
    """One pair of hosts in the pairwise stage: the all_reduce among the ranks of both hosts."""

    round: int  # 0-based round of ``launcher.preflight.health.pair_rounds``
    nodes: tuple[int, int]  # the two hosts' node ranks (torchrun's GROUP_RANK)
    bytes: int
    time_us: float  # microseconds per call, the slower rank's
    busbw_gbs: float  # nccl-tests' busbw over the pair's ranks, GB/s
    passes: int = 1  # 2: a first pass would have named a host; the better of two passes


class DeviceResult(_Line):
    """One rank's compute check: dense matmuls on its device for a fixed time."""

    rank: int
    node: int  # node rank (GROUP_RANK): index of the host in the job's host list
    local_rank: int
    device: str  # "cpu" or "cuda:N"
    kind: str  # what devices are compared against: "cpu", or the GPU's name (e.g. "NVIDIA H100 80GB HBM3")
    dtype: str  # float32, bfloat16 or float16
    size: int  # n of the n×n matmuls; each is 2n³ floating-point operations
    tflops: float  # TFLOP/s (1e12 floating-point operations per second) achieved


class CollectiveResult(_Line):
    """What rank 0 prints after a successful run (the ``GPTLAUNCH_COLLECTIVE`` line)."""

    backend: str  # gloo or nccl, as resolved from --backend
    world_size: int
    hosts: list[str]  # distinct host names, in rank order of first appearance
    ifname: dict[str, str | None]  # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME on rank 0, None if unset
    master: str  # MASTER_ADDR:MASTER_PORT as rank 0 saw it
    torch: str  # torch version on rank 0
    iters: int
    warmup: int
    init_s: float  # rank 0's seconds in init_process_group: includes waiting for the last rank
    results: list[SizeResult]
    pairs: list[PairResult] = []  # the pairwise stage (--pairs), in round order
    compute: list[DeviceResult] = []  # the compute check (--compute-s), one per rank in rank order
    # node rank -> its `nvidia-smi --query-gpu` CSV (``launcher.preflight.gpu_health``; hosts with GPUs)
    gpu_query: dict[int, str] = {}


class CollectiveError(_Line):
    """What a failing rank prints (the ``GPTLAUNCH_COLLECTIVE_ERROR`` line)."""

    rank: int
    host: str
    backend: str
    ifname: dict[str, str | None]
    master: str
    phase: Phase  # init: no group; collective: a call failed; check: a wrong sum; compute: a device failed
    message: str  # one line, names the backend, the interface setting and MASTER_ADDR:MASTER_PORT


def bus_bandwidth(size_bytes: int, time_s: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) of an all_reduce of ``size_bytes`` taking ``time_s``
    seconds over ``world_size`` ranks, by nccl-tests' definition (doc/PERFORMANCE.md): algbw =
    size / time, busbw = algbw * 2(n-1)/n (0 for one rank: nothing crosses a link)."""
    if size_bytes < 0 or time_s <= 0 or world_size < 1:
        raise ValueError(
            f"need size_bytes >= 0, time_s > 0 and world_size >= 1, got {size_bytes}, {time_s}, {world_size}"
        )
    algbw = size_bytes / time_s / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


_Model = TypeVar("_Model", bound=_Line)


def _find_lines(output: str, marker: str, model: type[_Model]) -> list[_Model]:
    """Every well-formed ``marker {json}`` line of ``output``, in order. The marker may follow a
    prefix (torchrun's ``[rank0]:`` or ``[default0]:``) but not a word character, so
    GPTLAUNCH_COLLECTIVE never matches inside GPTLAUNCH_COLLECTIVE_ERROR; broken lines are skipped."""
    pattern = re.compile(rf"(?<!\w){re.escape(marker)} (\{{.*\}})\s*$")
    found = []
    for line in output.splitlines():
        match = pattern.search(line)
        if match is None:
            continue
        try:
            found.append(model.model_validate_json(match.group(1)))
        except ValidationError:
            continue  # cut off or interleaved with another rank's output
    return found


def parse_result(output: str) -> CollectiveResult | None:
    """The result line in ``output`` (mixed text, e.g. torchrun's), the last one if several, or
    None when there is none."""
    found = _find_lines(output, MARKER, CollectiveResult)
    return found[-1] if found else None


def parse_errors(output: str) -> list[CollectiveError]:
    """Every rank's error line in ``output``, in order (empty when there is none)."""
    return _find_lines(output, ERROR_MARKER, CollectiveError)


def format_table(result: CollectiveResult) -> str:
    """The result for humans: a title line, then one row per size (bytes, µs per call, GB/s)."""
    ifnames = ", ".join(f"{k}={v}" for k, v in result.ifname.items() if v) or "no *_SOCKET_IFNAME set"
    title = (
        f"all_reduce sum float32, {result.backend}, {result.world_size} rank(s) on "
        f"{len(result.hosts)} host(s), {ifnames}, init {result.init_s:.2f} s"
    )
    header = f"{'size (B)':>12} {'time (µs)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"
    rows = [
        f"{r.bytes:>12} {r.time_us:>12.1f} {r.algbw_gbs:>13.3f} {r.busbw_gbs:>13.3f}" for r in result.results
    ]
    return "\n".join([title, header, *rows])
