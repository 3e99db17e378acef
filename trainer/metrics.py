"""Metrics: ``metrics.jsonl`` + TensorBoard events on rank 0, MFU, and a progress display."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gptlaunch.files import atomic_write_text

# Dense bf16 peak FLOP/s of common accelerators (vendor datasheets), keyed by a substring of
# torch.cuda.get_device_name(). Anything else is measured.
KNOWN_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "V100": 125e12}
PEAK_FILE = "peak_flops.json"  # in the run dir: measured peaks, for the run's later attempts


def measure_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 8) -> float:
    """Achievable matmul FLOP/s of this process on ``device`` in ``dtype``: best of ``repeats`` timed
    (n × n) @ (n × n) products, each 2·n³ FLOPs. On the CPU this is the practical peak that MFU is
    measured against (it depends on the threads this process may use)."""
    # A generator of its own: the global RNG streams (dropout) must not depend on this measurement.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    best = float("inf")
    for _ in range(repeats + 1):  # the first product warms up caches and kernels
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(
    configured: float | None, device: torch.device, dtype: torch.dtype, run_dir: Path | None = None
) -> float:
    """FLOP/s of one device for MFU: the configured value, a datasheet value for a known GPU, or a
    measurement, kept in ``run_dir/peak_flops.json`` (when given) for the run's later attempts, and
    later jobs that resume from it, on the same host, device, dtype, thread count and torch: a retry
    does not pay it again (about 1.8 s of start-up on a 2-core CPU), and every attempt's MFU has the
    same denominator. ``--peak-flops`` replaces a measurement taken under load."""
    if configured:
        return configured
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    known = next((v for k, v in KNOWN_PEAK_FLOPS.items() if device.type == "cuda" and k in name), None)
    if known is not None:
        return known
    if run_dir is None:
        return measure_peak_flops(device, dtype)
    key = f"{socket.gethostname()} {name} {dtype} threads={torch.get_num_threads()} torch={torch.__version__}"
    return _kept(run_dir / PEAK_FILE, key, lambda: measure_peak_flops(device, dtype))


def _kept(path: Path, key: str, measure: Callable[[], float]) -> float:
    """``path``'s value under ``key``, else ``measure()``, then added to ``path`` (best effort: a
    run dir that cannot take it only costs the next attempt a measurement)."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or cut short
        kept = {}
    kept = kept if isinstance(kept, dict) else {}
    value = kept.get(key)
    if isinstance(value, int | float) and value > 0:
        return float(value)
    value = measure()
    with contextlib.suppress(OSError):
        atomic_write_text(path, json.dumps({**kept, key: value}, indent=2) + "\n")
    return value


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.
    Only rank 0 makes one."""

    def __init__(self, run_dir: Path, start_step: int) -> None:
        """Metrics of a run resumed at ``start_step`` continue its files; records of later steps (from
        an attempt that crashed after its last checkpoint) are dropped, as they are about to be redone."""
        from torch.utils.tensorboard import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        _truncate_after(path, start_step)
        self._jsonl = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        step = int(record["step"])
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, int | float):
                self._tb.add_scalar(key, value, step)
        self._ranks(record, step)

    def _ranks(self, record: dict[str, Any], step: int) -> None:
        """A log interval's per-rank numbers as TensorBoard scalars: each rank's own throughput
        (``rank_tokens_per_s/rank_K``, tokens/s), their spread (the fastest over the slowest, 1.0 when
        even) and the ranks named stragglers (``stragglers``: how many; ``straggler_ratio/rank_K``: the
        named rank's step time over the median)."""
        per_rank = record.get("rank_tokens_per_s")
        if not per_rank:
            return
        for rank, tokens_per_s in enumerate(per_rank):
            self._tb.add_scalar(f"rank_tokens_per_s/rank_{rank}", tokens_per_s, step)
        if min(per_rank) > 0:
            self._tb.add_scalar("rank_tokens_per_s_spread", max(per_rank) / min(per_rank), step)
        named = record.get("stragglers", [])
        self._tb.add_scalar("stragglers", len(named), step)
        for straggler in named:
            self._tb.add_scalar(f"straggler_ratio/rank_{straggler['rank']}", straggler["ratio"], step)

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()


def _truncate_after(path: Path, step: int) -> None:
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _step_of(line) <= step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(kept))


def _step_of(line: str) -> float:
    """The step of a metrics line; infinity for a line a crash cut short (so it is dropped)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


class Progress:
    """A rich progress bar when stdout is a terminal, plain log lines otherwise (log files, CI)."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self._bar = None
        self.enabled = enabled
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, info: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)

    def log(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
