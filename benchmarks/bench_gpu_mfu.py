"""GPT-2-size throughput and MFU of the trainer on one GPU, variant by variant, with a profile of each.

Every variant is one ``trainer train --preset gpt2`` run (1024-token sequences, bf16 autocast,
``torch.compile``) in a process of its own, on data prepared once. Its figures are the trainer's own
``tokens_per_s`` and ``mfu`` from ``metrics.jsonl`` (MFU: 6N + 12·L·d·T FLOPs per token against the
datasheet peak that ``trainer.metrics.KNOWN_PEAK_FLOPS`` gives the GPU, 989 TFLOP/s for an H200):
the median of the log records of steps 11–40, after the first interval (which holds the compile) and
before the profiled steps. Steps 41–43 run under ``torch.profiler``; the trace of each variant is
summarised (GPU busy and idle time per step, kernel time by kind, the top kernels).

A variant is ``NAME:key=value,...`` with keys

- ``mb``: micro-batch (sequences); ``best``: the fastest micro-batch of the plain variants run so far;
- ``accum``: micro-steps per optimizer step (``--global-batch-tokens``), default 1;
- ``attn``: ``torch`` (torch's own SDPA order: the trainer as it is; torch 2.11 picks cuDNN's fused
  attention on an H200 by itself) or ``cudnn`` (``sdpa_kernel`` with cuDNN first, then torch's order,
  around the trainer's compute context); ``best``: the faster of a pair measured at one micro-batch;
- ``sync``: ``step`` (the trainer: the loss is read on the host after every step) or ``log`` (only at
  log steps: what the per-step host sync costs; a measurement, not a trainer mode);
- ``mode``: the ``--compile-mode`` (``default``, ``reduce-overhead``, ``max-autotune-no-cudagraphs``);
- ``need``: seconds of the budget the variant needs to start (max-autotune compiles for minutes).

``BENCH_PROFILE=0`` leaves the profiler out. ``benchmarks/gpu_session.sh`` runs this with the GPU tests
in one call on a machine without network; figures and the commands are in docs/benchmarks.md.

Usage (on the GPU machine; ``--dry``: the tiny preset on the CPU without compile, the same code paths
in seconds):

    python3 benchmarks/bench_gpu_mfu.py all --out DIR --budget-s 240 --micro \\
        --variants b16:mb=16 b32:mb=32 cudnn:mb=best,attn=cudnn
    python3 benchmarks/bench_gpu_mfu.py one ...    # one variant (what ``all`` starts per variant)
    python3 benchmarks/bench_gpu_mfu.py micro ...  # GEMMs and attention of the model alone

``all`` appends to ``DIR/results.json`` and rewrites ``DIR/summary.md`` after every variant, so a run
cut short keeps what it measured; it copies the first variant's trace and the fastest one's there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpu_mfu_micro import run_micro
from gpu_mfu_report import render
from gpu_mfu_run import (
    DRY_LOG,
    DRY_PROFILE_AT,
    DRY_STEPS,
    LOG_INTERVAL,
    PROFILE_AT,
    PROFILE_STEPS,
    REPO_ROOT,
    STEPS,
    WORK,
    Variant,
    patch_trainer,
    run_one,
    trainer_argv,
    variant_spec,
)
from gpu_mfu_sweep import best_attn, best_plain_mb, child, cudnn_failed, env_info, load, run_all, save
from gpu_mfu_trace import KINDS, analyze_trace, kind_of

__all__ = [  # the modules above hold the code; these names stay reachable from here
    "DRY_LOG",
    "DRY_PROFILE_AT",
    "DRY_STEPS",
    "KINDS",
    "LOG_INTERVAL",
    "PROFILE_AT",
    "PROFILE_STEPS",
    "REPO_ROOT",
    "STEPS",
    "WORK",
    "Variant",
    "analyze_trace",
    "best_attn",
    "best_plain_mb",
    "child",
    "cudnn_failed",
    "env_info",
    "kind_of",
    "load",
    "main",
    "patch_trainer",
    "render",
    "run_all",
    "run_micro",
    "run_one",
    "save",
    "trainer_argv",
    "variant_spec",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("all", "one", "micro"))
    p.add_argument("--out", default="bench_gpu_out")
    p.add_argument("--variants", nargs="*", default=["b16:mb=16", "b32:mb=32"])
    p.add_argument("--variant", help="one: the variant")
    p.add_argument("--result", help="one/micro: where the result JSON goes")
    p.add_argument("--micro", action="store_true", help="all: also time the GEMMs and attention alone")
    p.add_argument("--micro-after", type=int, default=1, help="all: after this many variants")
    p.add_argument("--budget-s", type=float, default=300.0, help="all: no variant starts after this")
    p.add_argument("--min-run-s", type=float, default=40.0, help="all: a variant needs this much budget left")
    p.add_argument("--run-timeout-s", type=float, default=150.0)
    p.add_argument(
        "--text-files", nargs="+", default=[str(REPO_ROOT.parent / "shared/data/wikitext-2/valid.txt")]
    )
    p.add_argument("--data-dir", type=Path, default=WORK / "data")
    p.add_argument(
        "--dry", action="store_true", help="tiny preset on the CPU, no compile: the code paths only"
    )
    args = p.parse_args()
    args.text_files = [str(Path(f).resolve()) for f in args.text_files]
    if args.mode == "one":
        return run_one(args)
    if args.mode == "micro":
        return run_micro(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
