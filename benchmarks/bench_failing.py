"""How soon the launcher knows an attempt fails: a local 2-node job's rank 1 SIGKILLed, then the job's
status read every 10 ms until it says the attempt is failing (``JobStatus.failing``, what the console's
hold waits for: ``launcher.job.survivors``).

Each round submits ``--nodes 2 --retries 1 --detach -- --no-compile --max-steps 400`` into a fresh jobs
root, waits until both ranks beat past step 5, kills rank 1 and prints the seconds to ``failing``,
then cancels the job. ``--load N`` runs N busy processes meanwhile (a loaded machine, as under the test
suite).

Usage: ``python benchmarks/bench_failing.py [--rounds N] [--load N]``. Exit code 1 when a round fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procs import REPO_ROOT

TRAINER = ["--no-compile", "--max-steps", "400", "--checkpoint-interval", "1000", "--eval-interval", "100000"]


def _beats(job: Path) -> list[dict[str, int]]:
    found = []
    for path in (job / "heartbeat").glob("node-*/rank-*.json"):
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    return found


def _wait(what: str, ready: object, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not callable(ready) or not ready():
        if time.monotonic() > deadline:
            sys.exit(f"bench_failing: no {what} in {timeout_s:.0f} s")
        time.sleep(0.01)


def one_round(jobs: Path) -> float:
    """Seconds from rank 1's SIGKILL to the status naming the attempt failing."""
    launcher = str(Path(sys.executable).with_name("launcher"))
    submit = [launcher, "--jobs-root", str(jobs), "submit", "--nodes", "2", "--retries", "1", "--detach"]
    subprocess.run([*submit, "--", *TRAINER], cwd=REPO_ROOT, check=True, capture_output=True)
    job = max(jobs.iterdir(), key=lambda p: p.stat().st_mtime)
    _wait("step 5 of both ranks", lambda: len(b := _beats(job)) == 2 and all(x["step"] >= 5 for x in b))
    killed = time.monotonic()
    os.kill(next(b["pid"] for b in _beats(job) if b["rank"] == 1), signal.SIGKILL)
    _wait("failing status", lambda: json.loads((job / "status.json").read_text()).get("failing"))
    seconds = time.monotonic() - killed
    subprocess.run([launcher, "--jobs-root", str(jobs), "cancel", job.name], capture_output=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default: 3)")
    parser.add_argument("--load", type=int, default=0, help="busy processes meanwhile (default: 0)")
    args = parser.parse_args()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-failing-") as tmp:
            seconds = [one_round(Path(tmp)) for _ in range(args.rounds)]
    finally:
        for burner in burners:
            burner.kill()
    print(f"kill -> failing, {args.load} busy processes: " + ", ".join(f"{s:.2f}" for s in seconds)
          + f" s (median {statistics.median(seconds):.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
