"""The collective preflight's results as the launcher reads them, and the health gate's verdict: which
host slows the job down, from the preflight's pairwise, compute and GPU stages
(``launcher.preflight.collective --pair-bytes B --compute-s S --gpu-health``). Pure; imports no torch.

Bandwidth is nccl-tests' (``bus_bandwidth``); hosts meet in rounds of pairs (``pair_rounds``). A host
is named for its links (``link_findings``, like DLRover's paired node check), its devices
(``compute_findings``) or its GPUs (``gpu_findings``), each ``Finding`` one line that starts with the
host's name, e.g. ``gl-h3: link 0.04 GB/s on eth0, below half the median 0.61 GB/s (pairs
gl-h2-gl-h3 0.04, gl-h3-gl-h4 0.04 GB/s)``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from launcher.job.measurements import CollectiveResult, DeviceResult, PairResult
from launcher.job.options import GateOptions
from launcher.job.torchrun import trainer_flag
from launcher.preflight import gpu_health

LINK_FRACTION = 0.5  # a host whose best pair is below this fraction of the median host's best is slow
COMPUTE_FRACTION = 0.8  # a device below this fraction of its kind's median TFLOP/s is slow

PRECISIONS = ("bf16", "fp16", "fp32")  # the trainer's --precision choices
# Per pair all_reduce: ~20 ms on a test veth, over several scheduler slices; 0.3 s at 500 Mbit/s.
PAIR_BYTES = 16 * 2**20
COMPUTE_S = 1.0  # seconds of matmuls per device: enough for a steady figure, short next to a job
GATE_TIMEOUT_S = 60.0  # --health-check: to form the group, and for each call of the gate


@dataclass(frozen=True)
class GateSettings:
    """What the health gate measures and what it names."""

    compute_s: float = COMPUTE_S  # 0: no compute check
    min_busbw: float | None = None  # GB/s: a pair below it is slow whatever the median
    precision: str = "bf16"  # the job's --precision: the compute check's dtype
    gpus_per_node: int = 1  # the job's processes per node: GPUs each host with GPUs needs

    @classmethod
    def of_job(cls, trainer_args: list[str], opts: GateOptions, nproc_per_node: int) -> GateSettings:
        """The gate of a job: its ``--precision`` (the trainer's default bf16), ``--min-busbw``,
        ``--health-compute-s`` and processes per node."""
        precision = trainer_flag(trainer_args, "--precision") or "bf16"
        compute_s = COMPUTE_S if opts.health_compute_s is None else opts.health_compute_s
        return cls(compute_s, min_busbw=opts.min_busbw, precision=precision, gpus_per_node=nproc_per_node)

    def worker_argv(
        self, nnodes: int, node_rank: int | str, master: tuple[str, int | str], timeout_s: float
    ) -> list[str]:
        """The arguments after a node's interpreter that run the gate there: the collective preflight
        under torchrun (``gpus_per_node`` ranks, this node being ``node_rank``, rank 0's store at
        ``master``) with the gate's stages."""
        argv = [
            "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={self.gpus_per_node}",
            f"--node-rank={node_rank}", f"--master-addr={master[0]}", f"--master-port={master[1]}",
            "-m", "launcher.preflight.collective", f"--timeout-s={timeout_s:g}",
            f"--compute-s={self.compute_s:g}", f"--precision={self.precision}", f"--pair-bytes={PAIR_BYTES}",
            "--gpu-health",  # the worker queries nvidia-smi only where its device is a GPU
        ]  # fmt: skip
        return argv + ([f"--min-busbw={self.min_busbw:g}"] if self.min_busbw is not None else [])


def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """The pairwise stage's schedule over hosts 0..n-1: rounds of disjoint pairs whose union is the
    ring 0-1-…-(n-1)-0, so each host is in two pairs (one pair for n = 2, none for n < 2). Two rounds
    for an even n, three for an odd n (the ring's closing edge waits for its own round)."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    first = [(i, i + 1) for i in range(0, n - 1, 2)]
    second = [(i, (i + 1) % n) for i in range(1, n, 2)]
    if n % 2 == 0:
        return [first, second]
    return [first, second, [(n - 1, 0)]]


@dataclass(frozen=True)
class Finding:
    """A host the gate names: which check, its figure and the line a user reads."""

    host: str
    check: Literal["link", "compute", "gpu"]
    figure: float | None  # GB/s (link), TFLOP/s (compute); None for gpu (the line has the field's value)
    line: str  # starts with the host's name
    fatal: bool = True  # False: a warning, reported but never refusing a launch


def _pair_name(pair: PairResult, hosts: Sequence[str]) -> str:
    return f"{hosts[pair.nodes[0]]}-{hosts[pair.nodes[1]]}"


def link_findings(
    pairs: Sequence[PairResult], hosts: Sequence[str], ifnames: dict[str, str], min_busbw: float | None
) -> list[Finding]:
    """The hosts whose best pair is below half the median host's best pair (so: every pair of theirs
    is), or below ``min_busbw`` GB/s when given; in host order. The median is over each host's best
    pair, not over pairs: with three hosts, two of the three pairs have the slow host in them, and
    their median would be slow too. ``hosts[node]`` names node ranks; ``ifnames`` maps a host to the
    interface it used (shown when known). Empty when there are no pairs."""
    mine = {node: [p for p in pairs if node in p.nodes] for node in range(len(hosts))}
    best = {node: max(p.busbw_gbs for p in own) for node, own in mine.items() if own}
    if not best:
        return []
    median = statistics.median(best.values())
    half = LINK_FRACTION * median
    threshold = max(half, min_busbw or 0.0)
    why = (
        f"below --min-busbw {min_busbw:g} GB/s"
        if min_busbw is not None and min_busbw >= half
        else f"below half the median {median:.3g} GB/s"
    )
    found = []
    for node, figure in best.items():
        if figure >= threshold:
            continue
        host = hosts[node]
        where = f" on {ifnames[host]}" if host in ifnames else ""
        each = ", ".join(f"{_pair_name(p, hosts)} {p.busbw_gbs:.3g}" for p in mine[node])
        line = f"{host}: link {figure:.3g} GB/s{where}, {why} (pairs {each} GB/s)"
        found.append(Finding(host, "link", figure, line))
    return found


def compute_findings(devices: Sequence[DeviceResult], hosts: Sequence[str]) -> list[Finding]:
    """Every device below COMPUTE_FRACTION × the median TFLOP/s of its kind in its dtype (a CPU
    without native bf16 computes in fp32, and is compared with those alike), in rank order."""
    groups = {(d.kind, d.dtype) for d in devices}
    medians = {g: statistics.median(d.tflops for d in devices if (d.kind, d.dtype) == g) for g in groups}
    found = []
    for d in devices:
        median = medians[(d.kind, d.dtype)]
        if d.tflops >= COMPUTE_FRACTION * median:
            continue
        host = hosts[d.node]
        count = sum(1 for other in devices if (other.kind, other.dtype) == (d.kind, d.dtype))
        line = (
            f"{host}: compute {d.tflops:.3g} TFLOP/s on {d.device} (rank {d.rank}, {d.dtype}), below "
            f"{COMPUTE_FRACTION:g} × the median {median:.3g} TFLOP/s of {count} {d.kind} device(s)"
        )
        found.append(Finding(host, "compute", d.tflops, line))
    return found


def bus_bandwidth(size_bytes: int, time_s: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) of an all_reduce of ``size_bytes`` taking ``time_s``
    seconds over ``world_size`` ranks, by nccl-tests' definition (doc/PERFORMANCE.md): algbw =
    size / time, busbw = algbw * 2(n-1)/n (0 for one rank: nothing crosses a link), the bandwidth
    each link needs, so comparable with the hardware's peak whatever n."""
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


def pairs_table(pairs: Sequence[PairResult], hosts: Sequence[str]) -> str:
    """The pairwise stage for humans: one row per pair (round, pair, µs per call, busbw)."""
    header = f"{'round':>5}  {'pair':<24} {'time (µs)':>12} {'busbw (GB/s)':>13}"
    rows = [
        f"{p.round + 1:>5}  {_pair_name(p, hosts):<24} {p.time_us:>12.1f} {p.busbw_gbs:>13.3f}" for p in pairs
    ]
    return "\n".join([header, *rows])


def compute_summary(devices: Sequence[DeviceResult]) -> str:
    """One line per kind of device: count, dtype, and the median, lowest and highest TFLOP/s."""
    lines = []
    for kind in sorted({d.kind for d in devices}):
        figures = [d.tflops for d in devices if d.kind == kind]
        dtypes = ", ".join(sorted({d.dtype for d in devices if d.kind == kind}))
        median = statistics.median(figures)
        lines.append(
            f"compute: {len(figures)} {kind} device(s), {dtypes} matmul: median {median:.3g} TFLOP/s "
            f"(lowest {min(figures):.3g}, highest {max(figures):.3g})"
        )
    return "\n".join(lines)


def findings(
    result: CollectiveResult, hosts: Sequence[str], ifnames: dict[str, str], settings: GateSettings
) -> list[Finding]:
    """Every host the gate names from one preflight result: slow links, slow devices, unhealthy
    GPUs; and the GPU warnings (``fatal`` False)."""
    return [
        *link_findings(result.pairs, hosts, ifnames, settings.min_busbw),
        *compute_findings(result.compute, hosts),
        *gpu_findings(result.gpu_query, hosts, settings.gpus_per_node),
    ]


def gpu_findings(queries: dict[int, str], hosts: Sequence[str], gpus_per_node: int) -> list[Finding]:
    """The GPU health of each host from its ``nvidia-smi --query-gpu`` output (``gpu_health``); a
    host whose query failed or printed something else is named with what it printed."""
    found = []
    for node, text in sorted(queries.items()):
        host = hosts[node]
        try:
            issues = gpu_health.judge(gpu_health.parse(text), gpus_per_node)
        except ValueError as e:
            found.append(Finding(host, "gpu", None, f"{host}: gpu health unknown: {e}"))
            continue
        found += [Finding(host, "gpu", None, f"{host}: {line}", fatal) for line, fatal in issues]
    return found


def report_text(result: CollectiveResult, hosts: Sequence[str], found: Sequence[Finding]) -> str:
    """``format_table``, the pairwise table, the compute summary, the warnings and the verdict: one
    line per named host (``found``'s fatal findings), or that none is, saying which stages ran."""
    parts = [format_table(result)]
    if result.pairs:
        rounds = len({p.round for p in result.pairs})
        again = ", each pair's better of 2 passes" if any(p.passes > 1 for p in result.pairs) else ""
        title = f"pairwise all_reduce, {len(result.pairs)} pair(s) in {rounds} round(s){again}:"
        parts += [title, pairs_table(result.pairs, hosts)]
    if result.compute:
        parts.append(compute_summary(result.compute))
    parts += [f"warning: {f.line}" for f in found if not f.fatal]
    named = [f for f in found if f.fatal]
    if named:
        parts += [f"health gate: {len({f.host for f in named})} host(s) named:", *(f.line for f in named)]
        return "\n".join(parts)
    stages = {"links": result.pairs, "compute": result.compute, "gpus": result.gpu_query}
    ran = [stage for stage, present in stages.items() if present]
    checked = f"{', '.join(ran)} checked" if ran else "no stage ran: one host, no compute check, no GPUs"
    parts.append(f"health gate: no host named ({len(hosts)} host(s); {checked})")
    return "\n".join(parts)


def named_text(named: Sequence[Finding], noun: str = "host") -> str:
    """The message of a refusal: ``the health gate named N host(s):``, then each finding's line, indented."""
    count = len({f.host for f in named})
    return f"the health gate named {count} {noun}(s):\n  " + "\n  ".join(f.line for f in named)
