"""Launches over 1, 2, 4, 8 and 16 SSH test hosts: time from `launcher submit --health-check` to the first
training step, split into its phases, and the wall time of `launcher check --collective`.

The hosts are the network namespaces of deploy/ssh/dev-hosts.sh (needs root), all on this machine.
Each submit trains the tiny preset for one step, one CPU process per host with one thread. Its merged
output is read line by line as it comes and each phase ends at a line:

- probe: submit started -> `launcher: parity:` (ssh to every host, the version probe, parity);
- preflight: -> `launcher: preflight took` (routes, rendezvous port, the health gate's all_reduce,
  pairs and matmuls);
- rendezvous: `launcher: job …` -> rank 0's `training: world_size=` (ssh to every host, the host
  agents, torchrun's rendezvous, the process group, data and model on every rank);
- first step: -> rank 0's `step 1/`.

Counts alternate in rounds (1, 2, 4, … then again), so that load from other processes hits all of
them alike; each figure is the median over rounds, and the ratio is N hosts ÷ 1 host. The hosts share
this machine's cores: a phase that is CPU work on every host (Python and torch start-up) has a floor of
about N ÷ cores × its 1-host time here, where N real hosts would take about 1×.

    python benchmarks/bench_scale.py [--hosts 1,2,4,8,16] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import DEFAULT_TEXT
from procs import REPO_ROOT, child_env, log

PHASES = ("probe", "preflight", "rendezvous", "first step")
# Where each phase ends (a line's start, after any "node0 | " label); rendezvous starts at JOB_LINE.
ENDS = {
    "probe": "launcher: parity: ",
    "preflight": "launcher: preflight took ",
    "rendezvous": "[rank0]: training: world_size=",
    "first step": "[rank0]: step 1/",
}
JOB_LINE = "launcher: job "
TIMEOUT_S = 600.0


def _launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli.main", *args]


def submit_phases(hostfile: Path, n: int, data: list[str], work: Path) -> dict[str, float]:
    """Seconds of each phase of one `submit --health-check` over the first ``n`` hosts (and "total")."""
    run = work / f"run-{n}-{time.monotonic_ns()}"
    argv = _launcher(
        "--jobs-root", str(work / "jobs"), "submit", "--scheduler", "ssh", "--hostfile", str(hostfile),
        "--nodes", str(n), "--omp-num-threads", "1", "--health-check", "--tee", "rank0",
        "--", *data, "--preset", "tiny", "--max-steps", "1", "--no-compile", "--eval-iters", "1",
        "--log-interval", "1", "--run-dir", str(run),
    )  # fmt: skip
    seen: dict[str, float] = {}
    output = []
    started = time.monotonic()
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, env=child_env()
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            text = line.split(" | ", 1)[-1]
            for mark, prefix in [("job", JOB_LINE), *ENDS.items()]:
                if mark not in seen and text.startswith(prefix):
                    seen[mark] = time.monotonic() - started
        code = proc.wait(timeout=TIMEOUT_S)
    missing = [m for m in ("job", *ENDS) if m not in seen]
    if code != 0 or missing:
        raise SystemExit(
            f"submit over {n} hosts: exit {code}, no line for {missing}:\n{''.join(output[-30:])}"
        )
    return {
        "probe": seen["probe"],
        "preflight": seen["preflight"] - seen["probe"],
        "rendezvous": seen["rendezvous"] - seen["job"],
        "first step": seen["first step"] - seen["rendezvous"],
        "total": seen["first step"],
    }


def check_s(hostfile: Path, n: int) -> float:
    """Wall seconds of `launcher check --collective` over the first ``n`` hosts."""
    started = time.monotonic()
    done = subprocess.run(
        _launcher("check", "--hostfile", str(hostfile), "--nodes", str(n), "--collective", "--json"),
        capture_output=True, text=True, cwd=REPO_ROOT, env=child_env(), timeout=TIMEOUT_S,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"check over {n} hosts: exit {done.returncode}:\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--hosts", default="1,2,4,8,16", help="host counts, comma-separated (default: %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds over every count (default: 1)")
    args = p.parse_args()
    counts = [int(c) for c in args.hosts.split(",")]
    up = subprocess.run(
        ["bash", str(REPO_ROOT / "deploy/ssh/dev-hosts.sh"), "up", "--hosts", str(max(counts))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    hostfile = Path(up.stdout.split()[-1])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = ["--text-files", str(DEFAULT_TEXT), "--data-dir", str(work / "data")]
        subprocess.run(
            [sys.executable, "-m", "trainer.cli", "prepare", *data], check=True, capture_output=True
        )
        check_s(hostfile, max(counts))  # warm-up: ssh master connections, page cache
        phases: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
        checks: dict[int, list[float]] = {n: [] for n in counts}
        for r in range(args.rounds):
            for n in counts:
                log(f"round {r + 1}/{args.rounds}: {n} host(s)")
                phases[n].append(submit_phases(hostfile, n, data, work))
                checks[n].append(check_s(hostfile, n))
    _print(counts, phases, checks, args.rounds)
    return 0


def _print(
    counts: list[int], phases: dict[int, list[dict[str, float]]], checks: dict[int, list[float]], rounds: int
) -> None:
    med = {n: {k: statistics.median(run[k] for run in phases[n]) for k in (*PHASES, "total")} for n in counts}
    check = {n: statistics.median(checks[n]) for n in counts}
    columns = [*PHASES, "total", "check --collective"]
    print("| hosts | " + " | ".join(f"{c} (s)" for c in columns) + " |")
    print("|" + " --- |" * (len(columns) + 1))
    for n in counts:
        cells = [f"{med[n][k]:.1f}" for k in (*PHASES, "total")] + [f"{check[n]:.1f}"]
        print(f"| {n} | " + " | ".join(cells) + " |")
    first, last = counts[0], counts[-1]
    ratios = [f"{med[last][k] / med[first][k]:.1f}" for k in (*PHASES, "total")] + [
        f"{check[last] / check[first]:.1f}"
    ]
    print(f"| {last} ÷ {first} | " + " | ".join(ratios) + " |")
    cores = os.cpu_count() or 1
    print(
        f"\nmedians of {rounds} round(s); {cores} cores shared by all hosts: CPU-bound phases have a floor "
        f"of about {last} ÷ {cores} = {last / cores:.1f}× the 1-host time here"
    )


if __name__ == "__main__":
    sys.exit(main())
