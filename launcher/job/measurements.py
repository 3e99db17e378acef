"""What the collective preflight measured, as data (``launcher.preflight.collective`` sends it as a
report: ``launcher.job.reports.CollectiveDone`` / ``CollectiveFailed``). Pure models, no torch: the
launcher reads them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Phase = Literal["init", "collective", "check", "compute"]


class _Line(BaseModel):
    # Unknown fields are ignored: a launcher older than the workers still reads their reports.
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
    """What rank 0 reports after a successful run."""

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
    """What a failing rank reports."""

    rank: int
    host: str
    backend: str
    ifname: dict[str, str | None]
    master: str
    phase: Phase  # init: no group; collective: a call failed; check: a wrong sum; compute: a device failed
    message: str  # one line, names the backend, the interface setting and MASTER_ADDR:MASTER_PORT
