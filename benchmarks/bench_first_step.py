"""``make run`` again: seconds from ``launcher submit`` to the console's ``step 1/`` line, with every
default (compile on), on a host that ran it before (its data prepared, its Inductor cache warm).

Each round runs ``launcher --jobs-root TMP submit --nodes 2 --gpus-per-node 1 -- --max-steps 5`` (what
``make run`` runs, with a short run) attached, as a user at a terminal does, and stamps each console
line as it comes. The first run warms the host and is not counted. Printed per round: when the
console showed step 1, and the parts of the start-up that rank 0 named (the launcher's ``first step``
line: launch, data, rendezvous, setup, compile). Goal (issue 61): 10 s.

Usage: ``python benchmarks/bench_first_step.py [--rounds N]``. Progress goes to stderr, the Markdown
table to stdout. Exit code 1 when a run fails (its output is shown).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procs import REPO_ROOT

COMMAND = ["submit", "--nodes", "2", "--gpus-per-node", "1", "--", "--max-steps", "5"]
STEP_1 = re.compile(r"\| \[rank0\]: step 1/")
PARTS = re.compile(r"^launcher: first step [\d.]+ s after the start: (?P<parts>.*)$")


def run_once(jobs_root: Path, timeout_s: float) -> tuple[float, str]:
    """(seconds from the start to the console's step 1, the start-up's parts as the console said them)."""
    launcher = Path(sys.executable).with_name("launcher")
    argv = [str(launcher), "--jobs-root", str(jobs_root), *COMMAND]
    started = time.monotonic()
    step_1, parts, seen = None, "", []
    with subprocess.Popen(
        argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if step_1 is None and STEP_1.search(line):
                step_1 = time.monotonic() - started
            if (match := PARTS.match(line.rstrip("\n"))) is not None:
                parts = match["parts"]
        code = proc.wait(timeout_s)
    if code != 0 or step_1 is None:
        sys.exit(f"bench_first_step: the run failed (exit {code}):\n{''.join(seen[-40:])}")
    return step_1, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="counted runs (default: 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default: 300)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-first-step-") as tmp:
        print("warming the host (not counted) ...", file=sys.stderr, flush=True)
        run_once(Path(tmp), args.timeout)
        rows = []
        for k in range(1, args.rounds + 1):
            seconds, parts = run_once(Path(tmp), args.timeout)
            print(f"round {k}: step 1 on the console after {seconds:.1f} s", file=sys.stderr, flush=True)
            rows.append((k, seconds, parts))
    print("| round | submit → console's step 1, s | rank 0's start-up |")
    print("| ---: | ---: | --- |")
    for k, seconds, parts in rows:
        print(f"| {k} | {seconds:.1f} | {parts} |")
    print(f"\nmedian {statistics.median(s for _, s, _ in rows):.1f} s (goal: 10 s)")


if __name__ == "__main__":
    main()
