"""What the collective preflight reports, read by the launcher without importing torch: its models
(``launcher.job.measurements``, re-exported here), the bandwidth formula and the table for humans.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md): algbw = size / time; busbw = algbw * 2(n-1)/n for
all_reduce, which is the bandwidth each link needs and so comparable with the hardware's peak,
whatever the number of ranks n. Units: GB/s = 1e9 bytes/s, time in microseconds per call, the slowest
rank's (as nccl-tests reports).
"""

from __future__ import annotations

from launcher.job.measurements import CollectiveError as CollectiveError
from launcher.job.measurements import CollectiveResult as CollectiveResult
from launcher.job.measurements import DeviceResult as DeviceResult
from launcher.job.measurements import PairResult as PairResult
from launcher.job.measurements import Phase as Phase
from launcher.job.measurements import SizeResult as SizeResult


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
