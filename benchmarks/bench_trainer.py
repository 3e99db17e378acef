"""Side-by-side CPU throughput benchmark of ``trainer train`` (preset tiny: context 128, micro-batch 16,
vocab 8192).

Three comparisons, each measured in the same run so that machine drift cancels out:

1. (a) plain fp32 eager (``--precision fp32 --no-compile``) vs (b) the default configuration (bf16
   autocast + torch.compile), both one process using every core; reports b/a (target >= 1.8).
2. (c) the default configuration under torchrun with world_size 1 vs (d) world_size 2, one thread per
   rank; reports the weak-scaling efficiency d / (2 c) (target >= 85%).
3. (d) vs (e) the same with the compiled graph split at DDP's gradient buckets (``--ddp-optimizer
   on``, the GPUs' default): reports d / e (target >= 0.97: the CPU's one graph costs no throughput).

Configurations are interleaved round by round (a, b, c, d, then d, c, b, a, ...), every value is the
median over rounds, ratios are computed from the medians, and the min/max of the per-round ratios show
the noise. Throughput is the trainer's own ``tokens_per_s`` from ``metrics.jsonl`` (global tokens per
second of step time, evaluation and checkpoints excluded): per run, the median of the records after
``--warmup-steps`` (which absorb torch.compile). Data is prepared once up front, so tokenizer training
is never timed. Before each run the benchmark waits a little for other processes to go quiet
(``--quiet-wait``) and records how much CPU they took during the run.

Usage: ``python benchmarks/bench_trainer.py [--steps N] [--repeats R] [--json]``. Progress goes to
stderr, the Markdown table (or JSON with ``--json``) to stdout. Exit code 1 when a run fails (its
output tail is shown), 2 for bad arguments or missing input text.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from common import add_run_flags, text_files
from procs import BenchError, available_cores
from throughput import (
    VOCAB_SIZE,
    Comparison,
    Config,
    RunResult,
    Series,
    Settings,
    comparison_values,
    data_flags,
    measure,
    prepare,
    read_metrics,
    run_config,
    run_rounds,
    train_command,
)
from throughput_report import as_json, fmt_ratio, markdown, ratio_cell

__all__ = [  # throughput.py and throughput_report.py hold the machinery; it stays reachable from here
    "COMPARISONS",
    "VOCAB_SIZE",
    "Comparison",
    "Config",
    "RunResult",
    "Series",
    "Settings",
    "as_json",
    "comparison_values",
    "configurations",
    "data_flags",
    "fmt_ratio",
    "main",
    "markdown",
    "measure",
    "parse_args",
    "prepare",
    "ratio_cell",
    "read_metrics",
    "run_config",
    "run_rounds",
    "train_command",
]


def configurations(threads: int) -> list[Config]:
    """The five measured configurations, in round order."""
    return [
        Config(
            "fp32_eager",
            "(a) fp32 eager: `--precision fp32 --no-compile`",
            1,
            threads,
            ("--precision", "fp32", "--no-compile"),
        ),
        Config("default", "(b) default: bf16 autocast + torch.compile", 1, threads),
        Config("torchrun_ws1", "(c) default, torchrun, 1 rank", 1, 1, torchrun=True),
        Config("torchrun_ws2", "(d) default, torchrun, 2 ranks", 2, 1, torchrun=True),
        Config(
            "ddp_split",
            "(e) as (d), the graph split at DDP's buckets: `--ddp-optimizer on`",
            2,
            1,
            ("--ddp-optimizer", "on"),
            torchrun=True,
        ),
    ]


COMPARISONS = (
    Comparison("b/a speed-up", "default", "fp32_eager", 1.0, 1.8, percent=False),
    Comparison("scaling efficiency d/(2c)", "torchrun_ws2", "torchrun_ws1", 2.0, 0.85, percent=True),
    # The CPU's default compiles DDP's model in one graph (trainer.config.resolved_ddp_optimizer).
    Comparison("one graph / split d/e", "torchrun_ws2", "ddp_split", 1.0, 0.97, percent=False),
)


def parse_args(
    argv: Sequence[str] | None,
    description: str | None = None,
    extend: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The flags of a throughput benchmark (this one's, or another's: ``description`` and ``extend``
    add its own). Exits 2 through argparse on bad input."""
    p = argparse.ArgumentParser(description=description or (__doc__.split("\n\n")[0] if __doc__ else None))
    p.add_argument(
        "--steps", type=int, default=40, help="measured steps per run, after warm-up (default: 40)"
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=10,
        help="steps excluded from the measurement, a multiple of --log-interval (default: 10)",
    )
    p.add_argument("--log-interval", type=int, default=5, help="steps per metrics record (default: 5)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument(
        "--threads",
        type=int,
        default=available_cores(),
        help="threads of (a) and (b) (default: all cores, %(default)s)",
    )
    add_run_flags(p, timeout_s=900.0, quiet_wait_s=20.0)
    p.add_argument("--json", action="store_true", help="print a JSON object instead of the Markdown table")
    if extend is not None:  # last: its set_defaults must override the defaults above
        extend(p)
    args = p.parse_args(argv)
    if min(args.steps, args.warmup_steps, args.log_interval, args.repeats, args.threads) < 1:
        p.error("--steps, --warmup-steps, --log-interval, --repeats and --threads must be >= 1")
    if args.warmup_steps % args.log_interval:
        p.error("--warmup-steps must be a multiple of --log-interval (records must not straddle it)")
    args.text_files = text_files(args.text_files, p)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        series, comparisons, meta = measure(args, configurations(args.threads), COMPARISONS, "bench_trainer-")
    except BenchError as e:
        print(f"bench: error: run failed: {e}", file=sys.stderr, flush=True)
        return 1
    print(as_json(series, comparisons, meta) if args.json else markdown(series, comparisons, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
