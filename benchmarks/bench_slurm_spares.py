"""What a lost SLURM node costs with a hot spare in the allocation (``--spare-nodes 1``) against a
requeue (no spare), side by side on the dev cluster (``deploy/slurm/dev-cluster.sh up --nodes 3``).

Each round runs both, one after the other: a 2-node job (tiny preset, one thread per rank) with
``--retries 1``; once both ranks are past ``--kill-step``, the node agent of rank 1's node (its job
step's task, parent of its torchrun agent) is SIGKILLed, as a lost node would be. From the attempt
record and the next attempt's heartbeats:

- detection: the kill → the controller has archived the attempt (the agent's srun step ended, and
  the controller in the allocation decided);
- restart: → the next attempt's first step is done (a spare: a new srun step in the same allocation;
  a requeue: the job back in the queue, allocated again, and its steps before training).

Usage: ``python benchmarks/bench_slurm_spares.py [--rounds N] [--kill-step K]``. Progress goes to
stderr, Markdown to stdout.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil
from common import text_files
from procs import BenchError, child_env, log

from gptlaunch.contract import Beat, read_beats
from launcher.job.logs import wait_terminal
from launcher.job.record import Attempt, JobRecord
from launcher.schedulers.slurm.scheduler import SlurmScheduler

ROOT = Path(__file__).resolve().parents[1]
MODES = {"spare": ["--spare-nodes", "1"], "requeue": []}
T = TypeVar("T")


def _beats(job_dir: Path) -> list[Beat]:
    return [b for node in sorted((job_dir / "heartbeat").glob("node-*")) for b in read_beats(node)]


def _until(what: str, found: Callable[[], T | None], timeout_s: float = 600) -> T:
    """Poll ``found()`` every 50 ms until it returns something true; that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := found():
            return value
        time.sleep(0.05)
    raise BenchError(f"{what}: not within {timeout_s:.0f} s")


def _node_task(pid: int) -> psutil.Process:
    """The node agent (its job step's task) a rank runs under."""
    for parent in psutil.Process(pid).parents():
        if "launcher.agent" in parent.cmdline():
            return parent
    raise BenchError(f"rank pid {pid} runs under no node agent")


def one_job(args: argparse.Namespace, tmp: Path, mode: str, k: int) -> dict[str, float]:
    """Seconds from the kill to the retry's decision, and from there to the next first step."""
    jobs = tmp / f"jobs-{mode}-{k}"
    cmd = [
        sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), "submit", "--scheduler", "slurm",
        "--nodes", "2", "--time", "15", "--retries", "1", *MODES[mode], "--",
        "--text-files", *map(str, args.text_files), "--data-dir", str(tmp / "data"), "--preset", "tiny",
        "--no-compile", "--max-steps", str(args.kill_step * 2), "--log-interval", "1",
        "--eval-interval", "1000000", "--run-dir", str(tmp / f"run-{mode}-{k}"),
    ]  # fmt: skip
    out = subprocess.run(cmd, env=child_env(1), capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode != 0:
        raise BenchError(f"submit failed: {out.stderr[-2000:]}")
    job_dir = jobs / out.stdout.strip().splitlines()[0]
    _until(
        "the kill step", lambda: len(b := _beats(job_dir)) == 2 and min(x.step for x in b) >= args.kill_step
    )
    rank1 = next(b for b in _beats(job_dir) if b.rank == 1)
    task = _node_task(rank1.pid)
    killed = time.time()
    task.send_signal(signal.SIGKILL)
    attempt_file = job_dir / "attempts" / "1" / "attempt.json"
    _until("attempt 1 archived", attempt_file.is_file)
    attempt = Attempt.model_validate_json(attempt_file.read_text())
    first = _until(
        "the next attempt's first step",
        lambda: next((b.time for b in _beats(job_dir) if b.start_step and b.step > b.start_step), None),
    )
    status = wait_terminal(SlurmScheduler().state, JobRecord(job_dir), 600, poll_s=0.5)
    if status is None or status.state != "succeeded":
        raise BenchError(f"{job_dir}: did not succeed: {status}")
    parts = {"detection": attempt.ended_at - killed, "restart": first - attempt.ended_at}
    log(f"{mode} {k + 1}: " + ", ".join(f"{p} {v:.1f} s" for p, v in parts.items()))
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--kill-step", type=int, default=15, help="kill rank 1's node agent once both ranks are past it"
    )
    p.add_argument("--text-files", nargs="+", help="input text (default: WikiText-2 valid.txt in ../shared)")
    args = p.parse_args(argv)
    args.text_files = text_files(args.text_files, p)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_slurm_spares-") as tmp:  # the nodes see /tmp
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for k in range(args.rounds):
                for mode in MODES:  # side by side, alternating
                    runs[mode].append(one_job(args, Path(tmp), mode, k))
    except BenchError as e:
        print(f"bench: error: {e}", file=sys.stderr, flush=True)
        return 1
    rows = [
        "| retry | detection, s | restart, s | kill → next first step, s |",
        "| --- | ---: | ---: | ---: |",
    ]
    totals = {}
    for mode, parts in runs.items():
        totals[mode] = statistics.median(sum(r.values()) for r in parts)
        d, r = (statistics.median(x[part] for x in parts) for part in ("detection", "restart"))
        rows.append(f"| {mode} | {d:.1f} | {r:.1f} | **{totals[mode]:.1f}** |")
    print("\n".join(rows))
    print(
        f"\nrequeue / spare: {totals['requeue'] / totals['spare']:.2f}×; medians of {args.rounds} rounds, "
        f"rank 1's node agent SIGKILLed past step {args.kill_step}; {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, "
        f"total {time.monotonic() - started:.0f} s · `python benchmarks/bench_slurm_spares.py`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
