"""The machinery of the CPU throughput benchmarks (``bench_trainer.py``, ``bench_watchdog.py``): the
configurations and comparisons they measure, one ``trainer train`` run and its ``metrics.jsonl``, the
interleaved rounds, and the comparisons' values from their medians."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from procs import (
    BenchError,
    CpuSample,
    available_cores,
    child_env,
    cpu_model,
    log,
    run_process,
    tail,
    wait_for_quiet,
)

VOCAB_SIZE = 8192


@dataclass(frozen=True)
class Config:
    """One trainer configuration to measure."""

    key: str
    label: str
    world_size: int
    threads_per_rank: int
    flags: tuple[str, ...] = ()  # extra ``trainer train`` flags
    torchrun: bool = False  # launch with ``python -m torch.distributed.run``
    env: tuple[tuple[str, str], ...] = ()  # extra environment; ``{run_dir}`` is the run's directory


@dataclass(frozen=True)
class Comparison:
    """``numerator / (scale × denominator)`` over configuration keys, with a target value."""

    name: str
    numerator: str
    denominator: str
    scale: float
    target: float
    percent: bool  # print as a percentage (efficiency) instead of a factor


@dataclass(frozen=True)
class RunResult:
    """One run of one configuration."""

    tokens_per_s: float  # global tokens/s: median over the measured metrics records
    mfu: float  # model FLOPs utilization as the trainer logs it (fraction of peak), same record
    wall_s: float  # seconds from process start to exit (startup, compile, eval, checkpoint included)
    other_load: float  # CPU used by processes outside the benchmark during the run, fraction of all cores


@dataclass
class Series:
    """All rounds of one configuration."""

    config: Config
    runs: list[RunResult] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Median global tokens/s over rounds."""
        return statistics.median(r.tokens_per_s for r in self.runs)

    @property
    def mfu(self) -> float:
        """Median MFU (fraction) over rounds."""
        return statistics.median(r.mfu for r in self.runs)


@dataclass(frozen=True)
class Settings:
    """What every run shares."""

    text_files: tuple[Path, ...]
    data_dir: Path
    work_dir: Path
    warmup_steps: int
    steps: int  # measured steps after the warm-up
    log_interval: int
    timeout_s: float  # per run, seconds
    quiet_wait_s: float  # before each run, wait up to this many seconds for other processes to calm down
    quiet_load: float  # ... until they use at most this fraction of the CPUs

    @property
    def max_steps(self) -> int:
        return self.warmup_steps + self.steps


def prepare(settings: Settings) -> None:
    """Tokenize the text once into ``settings.data_dir`` (never timed)."""
    cmd = [sys.executable, "-m", "trainer.cli", "prepare", *data_flags(settings)]
    start = run_process(cmd, child_env(available_cores()), settings.work_dir / "prepare.log", 3600)
    log(f"prepared data in {time.perf_counter() - start.t:.1f} s: {settings.data_dir}")


def data_flags(settings: Settings) -> list[str]:
    """Data flags of every run; the same inputs make ``trainer`` reuse the prepared data dir."""
    files = [str(p) for p in settings.text_files]
    return ["--text-files", *files, "--data-dir", str(settings.data_dir), "--vocab-size", str(VOCAB_SIZE)]


def train_command(config: Config, settings: Settings, run_dir: Path) -> list[str]:
    """The full command line of one run."""
    if config.torchrun:
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={config.world_size}"]
    else:
        launch = []
    never = str(10 * settings.max_steps)  # no evaluation or checkpoint before the last step
    options = {
        "--preset": "tiny",
        "--device": "cpu",
        "--micro-batch-size": "16",
        "--run-dir": str(run_dir),
        "--max-steps": str(settings.max_steps),
        "--log-interval": str(settings.log_interval),
        "--eval-interval": never,
        "--checkpoint-interval": never,
        "--eval-iters": "1",  # the final evaluation is not measured: keep it short
        "--resume": "never",
    }
    flags = [item for pair in options.items() for item in pair]
    program = [sys.executable, *launch, "-m", "trainer.cli", "train"]
    return [*program, *flags, *data_flags(settings), *config.flags]


def read_metrics(path: Path, settings: Settings, world_size: int) -> tuple[float, float]:
    """(global tokens/s, MFU) of one ``metrics.jsonl``: the median over the records after the warm-up
    steps, each covering ``log_interval`` steps. On a quiet machine this is the run's steady throughput;
    the median keeps a burst of foreign load in a few records from moving it.

    Raises BenchError when the records are missing or do not cover exactly the measured steps.
    """
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"cannot read {path}: {e}") from None
    measured = [r for r in records if "tokens_per_s" in r and r["step"] > settings.warmup_steps]
    covered = measured[-1]["step"] - settings.warmup_steps if measured else 0
    if covered != settings.steps:
        raise BenchError(f"{path}: records cover {covered} measured steps, expected {settings.steps}")
    sizes = {r.get("world_size") for r in measured}
    if sizes != {world_size}:
        raise BenchError(
            f"{path}: world_size {sorted(map(str, sizes))} in the records, expected {world_size}"
        )
    # The middle record (the two middle ones, averaged, for an even count), MFU from the same records.
    ranked = sorted(measured, key=lambda r: r["tokens_per_s"])
    mid = ranked[(len(ranked) - 1) // 2 : len(ranked) // 2 + 1]
    return statistics.fmean(r["tokens_per_s"] for r in mid), statistics.fmean(r["mfu"] for r in mid)


def run_config(config: Config, settings: Settings, round_no: int) -> RunResult:
    """Run one configuration once and read its throughput."""
    run_dir = settings.work_dir / f"{config.key}-r{round_no}"
    run_dir.mkdir()
    cmd = train_command(config, settings, run_dir)
    if settings.quiet_wait_s > 0:
        wait_for_quiet(settings.quiet_wait_s, settings.quiet_load)
    env = child_env(config.threads_per_rank) | {k: v.format(run_dir=run_dir) for k, v in config.env}
    start = run_process(cmd, env, run_dir / "output.log", settings.timeout_s)
    end = CpuSample.now()
    try:
        tps, mfu = read_metrics(run_dir / "metrics.jsonl", settings, config.world_size)
    except BenchError as e:
        raise BenchError(f"{e}\n--- output tail ---\n{tail(run_dir / 'output.log')}") from None
    shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints are large; the numbers are all we keep
    return RunResult(tps, mfu, end.t - start.t, end.other_load(start))


def run_rounds(configs: list[Config], settings: Settings, repeats: int) -> dict[str, Series]:
    """Interleave the configurations for ``repeats`` rounds, reversing the order every other round (so
    compared configurations stay adjacent and neither always runs first)."""
    series = {c.key: Series(c) for c in configs}
    for r in range(repeats):
        order = configs if r % 2 == 0 else configs[::-1]
        for config in order:
            res = run_config(config, settings, r)
            series[config.key].runs.append(res)
            log(
                f"round {r + 1}/{repeats} {config.label.split(':')[0]} world_size={config.world_size} "
                f"threads/rank={config.threads_per_rank}: {res.tokens_per_s:,.0f} tokens/s, "
                f"MFU {res.mfu:.1%} ({res.wall_s:.1f} s; other processes {res.other_load:.0%} of the CPUs)"
            )
    return series


def comparison_values(comp: Comparison, series: dict[str, Series]) -> dict[str, Any]:
    """The comparison from the medians, plus the per-round values and their min/max."""
    num, den = series[comp.numerator], series[comp.denominator]
    per_round = [
        a.tokens_per_s / (comp.scale * b.tokens_per_s) for a, b in zip(num.runs, den.runs, strict=True)
    ]
    value = num.tokens_per_s / (comp.scale * den.tokens_per_s)
    return {
        "name": comp.name,
        "numerator": comp.numerator,
        "denominator": comp.denominator,
        "percent": comp.percent,
        "value": value,
        "min": min(per_round),
        "max": max(per_round),
        "per_round": per_round,
        "target": comp.target,
        "met": value >= comp.target,
    }


def measure(
    args: argparse.Namespace, configs: list[Config], comparisons: Sequence[Comparison], prefix: str
) -> tuple[dict[str, Series], list[dict[str, Any]], dict[str, Any]]:
    """Prepare the data, run ``configs`` in interleaved rounds and compute ``comparisons``: (series,
    comparison values, metadata). Raises BenchError when a run fails."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        settings = Settings(
            args.text_files,
            work / "data",
            work,
            args.warmup_steps,
            args.steps,
            args.log_interval,
            args.timeout,
            args.quiet_wait,
            args.quiet_load,
        )
        prepare(settings)
        series = run_rounds(configs, settings, args.repeats)
    values = [comparison_values(c, series) for c in comparisons]
    loads = [r.other_load for s in series.values() for r in s.runs]
    meta = {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": metadata.version("torch"),
        "cpu": cpu_model(),
        "cores": available_cores(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "repeats": args.repeats,
        "log_interval": args.log_interval,
        "other_load_mean": statistics.fmean(loads),
        "other_load_max": max(loads),
        "wall_time_s": time.perf_counter() - start,
    }
    return series, values, meta
