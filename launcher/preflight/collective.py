"""Network preflight: a short all_reduce over every rank of a job, like nccl-tests' all_reduce_perf.

``python -m launcher.preflight.collective [--backend auto|gloo|nccl] [--sizes 4,65536,...] [--iters 5]
[--warmup 2] [--timeout-s 30]`` runs under torchrun on every host, with the job's backend and network
settings (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, read by torch itself). For each size it checks that
the sum is right, then times ``iters`` in-place float32 all_reduce (SUM) calls. Rank 0 reports what it
measured (``launcher.job.reports.CollectiveDone``, a ``CollectiveResult``) and prints a table on
stderr; a rank that fails reports why (``CollectiveFailed``, a ``CollectiveError``), prints it on
stderr and exits 1, after at most about ``--timeout-s`` seconds when the group cannot form. (With nccl,
a call that hangs past the timeout is ended by torch's watchdog, which aborts the process: torchrun
reports the signal, and no report is written.) The reports go into the directory named by
``GPTLAUNCH_REPORT_DIR`` (one file a rank), which the node agent forwards or the launcher reads; run
by hand without it, only the table and the errors are printed.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TextIO

from gptlaunch.contract import EXIT_FAILED
from launcher.job import reports
from launcher.job.measurements import CollectiveError, CollectiveResult, DeviceResult, Phase, SizeResult
from launcher.preflight import gpu_health
from launcher.preflight.collective_flags import FLOAT32_BYTES, parser
from launcher.preflight.health import bus_bandwidth, format_table
from launcher.preflight.health_measure import all_gather, measure_compute, measure_pairs, synchronizer

if TYPE_CHECKING:
    import torch

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class _Failed(Exception):
    """This rank cannot finish the preflight; its message says why (from torch, or the wrong sum)."""

    def __init__(self, phase: Phase, detail: str) -> None:
        super().__init__(detail)
        self.phase: Phase = phase


@dataclass(frozen=True)
class _Context:
    """This rank's place in the job and the settings it runs with, from torchrun's environment."""

    rank: int
    local_rank: int
    node: int  # node rank (torchrun's GROUP_RANK): which host of the job this rank runs on
    world_size: int
    backend: Literal["gloo", "nccl"]
    ifname: dict[str, str | None]
    master: str
    timeout_s: float


def _read_context(backend: str, timeout_s: float) -> _Context:
    """RANK/LOCAL_RANK/WORLD_SIZE as torchrun sets them (a plain ``python`` run is rank 0 of 1), the
    interface variables as this process sees them, and the backend (auto: nccl when CUDA is there)."""
    if backend == "auto":
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    env = os.environ
    return _Context(
        rank=int(env.get("RANK", 0)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        node=int(env.get("GROUP_RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        backend="nccl" if backend == "nccl" else "gloo",
        ifname={var: env.get(var) or None for var in IFNAME_VARS},
        master=f"{env.get('MASTER_ADDR') or '(unset)'}:{env.get('MASTER_PORT') or '(unset)'}",
        timeout_s=timeout_s,
    )


def _message(ctx: _Context, phase: Phase, detail: str) -> str:
    """One line naming the failure, the backend, the interface setting and the rendezvous address."""
    where = f"rank {ctx.rank} of {ctx.world_size} on {socket.gethostname()}"
    what = {
        "init": f"could not form the process group (timeout {ctx.timeout_s:g} s)",
        "collective": "an all_reduce failed",
        "compute": "the compute check failed",
        "check": "all_reduce gave a wrong sum",
    }[phase]
    hint = {
        "init": "check that every host runs this, reaches MASTER_ADDR:MASTER_PORT, and has that interface",
        "collective": "check the other ranks' errors and the interface setting on every host",
        "compute": "check this host's device (nvidia-smi, dmesg)",
        "check": "the network or the collective library corrupts data",
    }[phase]
    var = "NCCL_SOCKET_IFNAME" if ctx.backend == "nccl" else "GLOO_SOCKET_IFNAME"  # what the backend reads
    ifname = f"{var}={ctx.ifname[var]}" if ctx.ifname[var] else f"{var} (unset)"
    return (
        f"collective preflight failed on {where}: {what}: {detail} "
        f"(backend {ctx.backend}, {ifname}, MASTER_ADDR:MASTER_PORT {ctx.master}); {hint}"
    )


# Where in torch's or gloo's C++ sources an error was raised, e.g. "[enforce fail at /__w/.../device.cc:84]":
# noise to a user, who needs the sentence after it.
_SOURCE_LOCATION = re.compile(r"\[(?:enforce fail at )?[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")


def _one_line(exc: BaseException) -> str:
    """The exception's text on one line, without the C++ stack torch appends to some messages."""
    text = str(exc).split("Exception raised from", 1)[0]
    text = _SOURCE_LOCATION.sub("", text)
    return " ".join(text.split())[:1000] or type(exc).__name__


def _device(ctx: _Context) -> torch.device:
    """cuda:LOCAL_RANK for nccl (one GPU per process), else the CPU."""
    import torch

    if ctx.backend == "nccl":
        device = torch.device("cuda", ctx.local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _measure_size(
    size_bytes: int, ctx: _Context, device: torch.device, iters: int, warmup: int
) -> SizeResult:
    """Check the sum at ``size_bytes`` (each rank adds rank+1: n(n+1)/2, exact in float32), then time
    ``iters`` calls after ``warmup``. Collective; raises _Failed("check") on every rank when any rank
    saw a wrong element."""
    import torch
    import torch.distributed as dist

    sync = synchronizer(device)
    n = ctx.world_size
    expected = n * (n + 1) // 2
    data = torch.full((size_bytes // FLOAT32_BYTES,), float(ctx.rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(data, op=dist.ReduceOp.SUM)
    wrong = int((data != expected).sum().item())
    # Zeros for the timed calls: each in-place sum multiplies the values by n, which overflows to inf
    # on a large job with many iterations; the time does not depend on the values.
    data.zero_()
    for _ in range(warmup):
        dist.all_reduce(data, op=dist.ReduceOp.SUM)
    sync()
    dist.barrier()  # every rank starts the clock together: the time measures the network, not arrival
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(data, op=dist.ReduceOp.SUM)
    sync()
    per_call_s = (time.perf_counter() - start) / iters
    # The slowest rank's time, as nccl-tests reports; and whether any rank saw a wrong sum.
    stats = torch.tensor([per_call_s, float(wrong)], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    slowest_s, most_wrong = stats.tolist()
    if most_wrong > 0:
        raise _Failed(
            "check",
            f"at {size_bytes} bytes, {wrong} of {data.numel()} elements here and up to {int(most_wrong)} "
            f"on some rank differ from the expected {expected}",
        )
    algbw, busbw = bus_bandwidth(size_bytes, slowest_s, n)
    return SizeResult(bytes=size_bytes, time_us=slowest_s * 1e6, algbw_gbs=algbw, busbw_gbs=busbw)


def _measure(ctx: _Context, args: argparse.Namespace) -> CollectiveResult | None:
    """Form the group, run the compute check (``--compute-s`` > 0), measure every size, then the
    pairs (``--pair-bytes`` set), and leave the group (on every path). Returns the result on rank 0,
    None on the others; raises _Failed naming the phase that failed."""
    import torch
    import torch.distributed as dist

    phase: Phase = "init"
    try:
        device = _device(ctx)
        start = time.perf_counter()
        dist.init_process_group(
            ctx.backend,
            timeout=timedelta(seconds=ctx.timeout_s),
            # nccl: form the communicator now (not at the first call), so an unreachable peer fails here.
            device_id=device if ctx.backend == "nccl" else None,
        )
        init_s = time.perf_counter() - start
        phase = "collective"
        hosts = list(dict.fromkeys(all_gather(socket.gethostname())))  # distinct, in rank order
        compute = _compute(ctx, device, args.compute_s, args.precision)
        gpu_query = _gpu_query(ctx) if args.gpu_health and device.type == "cuda" else {}
        results = [_measure_size(size, ctx, device, args.iters, args.warmup) for size in args.sizes]
        pairs = []
        if args.pair_bytes is not None:
            pairs = measure_pairs(
                all_gather(ctx.node),
                device,
                args.pair_bytes,
                args.iters,
                args.warmup,
                ctx.timeout_s,
                args.min_busbw,
            )
    except _Failed:
        raise
    except Exception as e:  # torch raises RuntimeError / DistError subclasses, ValueError for bad env
        raise _Failed(phase, _one_line(e)) from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if ctx.rank != 0:
        return None
    return CollectiveResult(
        backend=ctx.backend,
        world_size=ctx.world_size,
        hosts=hosts,
        ifname=ctx.ifname,
        master=ctx.master,
        torch=torch.__version__,
        iters=args.iters,
        warmup=args.warmup,
        init_s=init_s,
        results=results,
        pairs=pairs,
        compute=compute,
        gpu_query=gpu_query,
    )


def _gpu_query(ctx: _Context) -> dict[int, str]:
    """Each host's ``nvidia-smi --query-gpu`` output (from its local rank 0), by node rank; hosts
    without nvidia-smi are absent. Collective."""
    mine = (ctx.node, gpu_health.query()) if ctx.local_rank == 0 else None
    return {node: text for node, text in filter(None, all_gather(mine)) if text is not None}


def _compute(ctx: _Context, device: torch.device, compute_s: float, precision: str) -> list[DeviceResult]:
    """Every rank's compute check (when asked), gathered on every rank, in rank order. Collective."""
    if compute_s <= 0:
        return []
    try:
        mine = measure_compute(ctx.rank, ctx.node, ctx.local_rank, device, precision, compute_s)
    except RuntimeError as e:  # a CUDA error on this device: name it, the other ranks time out
        raise _Failed("compute", _one_line(e)) from e
    return all_gather(mine)


def main(argv: list[str] | None = None) -> int:
    """Run the preflight on this rank; 0 on success, EXIT_FAILED (after an error line) otherwise."""
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    ctx = _read_context(args.backend, args.timeout_s)
    try:
        result = _measure(ctx, args)
    except _Failed as f:
        error = CollectiveError(
            rank=ctx.rank,
            host=socket.gethostname(),
            backend=ctx.backend,
            ifname=ctx.ifname,
            master=ctx.master,
            phase=f.phase,
            message=_message(ctx, f.phase, str(f)),
        )
        _write_line(sys.stderr, f"error: {error.message}")
        _report(reports.CollectiveFailed(node=ctx.node, rank=ctx.rank, error=error))
        return EXIT_FAILED
    if result is not None:
        _write_line(sys.stderr, format_table(result))
        _report(reports.CollectiveDone(node=ctx.node, rank=ctx.rank, result=result))
    return 0


def _report(report: reports.CollectiveDone | reports.CollectiveFailed) -> None:
    """Into the directory ``GPTLAUNCH_REPORT_DIR`` names, when it is set: this rank's own file."""
    directory = os.environ.get(reports.REPORT_DIR_ENV)
    if directory:
        reports.append_to(Path(directory), f"rank-{report.rank}", report)


def _write_line(stream: TextIO, text: str) -> None:
    """One write of ``text`` and its newline: under PYTHONUNBUFFERED, ``print`` writes the newline
    separately, and two ranks sharing torchrun's pipe would glue their lines into one."""
    stream.write(text + "\n")
    stream.flush()


if __name__ == "__main__":
    sys.exit(main())
