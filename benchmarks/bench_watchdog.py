"""What watching a run costs and what it buys: the heartbeat and the straggler exchange side by side
with them off, and how long a frozen rank takes to be reported.

1. Cost: (e) two torchrun ranks (tiny preset, one thread each) with no heartbeat directory and
   ``--no-straggler-check`` vs (f) the same watched as the launcher watches it (``GPTLAUNCH_JOB_ID``
   and ``GPTLAUNCH_HEARTBEAT_DIR`` set: the heartbeat, the flight recorder and its server, the forward
   clock of ``gptlaunch.compute``) and the trainer's straggler check on, interleaved round by round
   like ``bench_trainer.py`` (whose machinery this reuses).
   Reports f/e tokens/s (target >= 99%). With ``--log-interval 1`` (the default here) the straggler
   all-reduce runs every step: the worst case; by default the trainer runs it every 10 steps.
2. Detection latency: a 2-node local job (``launcher submit``) with ``--hang-timeout-s T``; once both
   ranks are past step 3, rank 1 is frozen with SIGSTOP; the latency is the time until the job is
   recorded as ended (stacks dumped, every process gone), against the 600 s process-group timeout
   that would otherwise end it.

Usage: ``python benchmarks/bench_watchdog.py [--repeats R] [--hang-rounds N] [--hang-timeout-s T]``.
Progress goes to stderr, Markdown to stdout.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_trainer import Comparison, Config, markdown, measure, parse_args
from procs import BenchError, child_env, log

from gptlaunch.contract import HEARTBEAT_DIR_ENV, JOB_ID_ENV, read_beats
from launcher.job.logs import wait_terminal
from launcher.job.record import JobRecord
from launcher.schedulers.local.scheduler import LocalScheduler

CONFIGS = [
    Config("off", "(e) 2 ranks, heartbeat and straggler check off", 2, 1, ("--no-straggler-check",), True),
    Config(
        "on",
        "(f) 2 ranks, the launcher's watch (heartbeat, flight recorder, forward clock), straggler all-reduce",
        2,
        1,
        torchrun=True,
        env=((JOB_ID_ENV, "bench-watchdog"), (HEARTBEAT_DIR_ENV, "{run_dir}/heartbeat")),
    ),
]
COMPARISONS = (Comparison("cost f/e", "on", "off", 1.0, 0.99, percent=True),)
PROCESS_GROUP_TIMEOUT_S = 600.0  # the trainer's --dist-timeout-s default


def _extend(p: argparse.ArgumentParser) -> None:
    p.set_defaults(log_interval=1)  # the straggler all-reduce every step: its worst case
    p.add_argument("--hang-rounds", type=int, default=3, help="frozen-rank runs (default: 3)")
    p.add_argument("--hang-timeout-s", type=float, default=30.0, help="the jobs' budget (default: 30)")


def _wait_steps(job_dir: Path, step: int, timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = [b for k in (0, 1) for b in read_beats(job_dir / "heartbeat" / f"node-{k}")]
        if len(beats) == 2 and all(b.phase == "step" and b.step >= step for b in beats):
            return beats
        time.sleep(0.1)
    raise BenchError(f"{job_dir}: the ranks did not reach step {step} in {timeout_s:.0f} s")


def hang_latency(text_files: list[str], data_dir: Path, jobs: Path, timeout_s: float) -> float:
    """Seconds from SIGSTOP of rank 1 to the job's recorded end, for one local 2-node job."""
    cmd = [
        sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), "submit", "--detach",
        "--nodes", "2", "--hang-timeout-s", str(timeout_s), "--", "--text-files", *text_files,
        "--data-dir", str(data_dir), "--preset", "tiny", "--no-compile", "--max-steps", "1000000",
        "--eval-interval", "1000000", "--checkpoint-interval", "1000000",
    ]  # fmt: skip
    out = subprocess.run(cmd, env=child_env(1), capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise BenchError(f"submit failed: {out.stderr[-2000:]}")
    job_id = out.stdout.strip().splitlines()[-1]
    job_dir = jobs / job_id
    rank1 = next(b for b in _wait_steps(job_dir, 3, 600) if b.rank == 1)
    frozen = time.monotonic()
    os.kill(rank1.pid, signal.SIGSTOP)
    status = wait_terminal(LocalScheduler().state, JobRecord(job_dir), timeout_s + 300, poll_s=0.1)
    took = time.monotonic() - frozen
    if status is None or not status.message.startswith("hang:"):
        raise BenchError(f"{job_dir}: not reported as a hang: {status}")
    log(f"hang reported after {took:.1f} s: {status.message}")
    return took


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, description=__doc__.split("\n\n")[0], extend=_extend)
    try:
        series, comparisons, meta = measure(args, CONFIGS, COMPARISONS, "bench_watchdog-")
        with tempfile.TemporaryDirectory(prefix="bench_watchdog-hang-") as tmp:
            files = [str(p) for p in args.text_files]
            latencies = [
                hang_latency(files, Path(tmp) / "data", Path(tmp) / "jobs", args.hang_timeout_s)
                for _ in range(args.hang_rounds)
            ]
    except BenchError as e:
        print(f"bench: error: {e}", file=sys.stderr, flush=True)
        return 1
    print(markdown(series, comparisons, meta))
    median = statistics.median(latencies)
    print(
        f"\nHang detection: rank 1 of a 2-node local job frozen with SIGSTOP at step ≥ 3, "
        f"`--hang-timeout-s {args.hang_timeout_s:g}`: reported (stacks dumped, job ended) after "
        f"**{median:.1f} s** (median of {len(latencies)}; {min(latencies):.1f}–{max(latencies):.1f} s), "
        f"against the {PROCESS_GROUP_TIMEOUT_S:.0f} s process-group timeout → "
        f"{PROCESS_GROUP_TIMEOUT_S / median:.0f}× sooner."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
