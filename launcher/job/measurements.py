"""What the preflight measured, as data: a host's probe (``launcher.preflight.probe``: versions, GPUs,
network; an SSH host's agent sends it as a ``launcher.job.reports.Probed`` report) and the collective
preflight's results (``launcher.preflight.collective`` sends them as ``CollectiveDone`` /
``CollectiveFailed`` reports). Pure models, no torch: the launcher reads them.
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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Gpu(_Strict):
    """One GPU this host's torch sees."""

    index: int
    name: str
    memory_bytes: int  # total memory, bytes


class Route(_Strict):
    """How this host reaches an address (``ip -o route get``)."""

    to: str  # the name or address asked for
    address: str  # what ``to`` resolved to here
    dev: str  # the interface the route leaves by
    src: str | None  # the source address packets get on that route


class Probe(_Strict):
    """One host's report. None means "not there": not installed, not built in, no GPU driver."""

    hostname: str
    os: str  # PRETTY_NAME of /etc/os-release, else platform.platform()
    kernel: str
    machine: str
    python: str
    python_executable: str
    torch: str | None
    torch_git: str | None  # the commit torch was built from
    cuda: str | None  # the CUDA version torch was built with (None: a CPU build)
    nccl: str | None
    cudnn: str | None
    driver: str | None  # the NVIDIA driver's version
    gpus: list[Gpu]
    launcher: str  # gptlaunch's version
    packages: dict[str, str | None]  # KEY_PACKAGES -> version, None when not installed
    image_digest: str | None  # our container image's digest (GPTLAUNCH_IMAGE_DIGEST), None outside it
    in_container: bool
    interfaces: dict[str, list[str]]  # up interfaces -> their IPv4 and IPv6 addresses
    route: Route | None  # how this host reaches --route-to (None: not asked, or it does not resolve)
    resolved: dict[str, str | None]  # --resolve/--route-to names -> address; None: no such name
    free_port: int | None  # a TCP port free on this host when probed (--free-port)
    probe_s: float  # seconds the probe took, the torch import included
