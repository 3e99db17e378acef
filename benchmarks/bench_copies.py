"""Hosts that share no file system: what ``--sync`` and the checkpoint copy cost, on the SSH dev
hosts (``deploy/ssh/dev-hosts.sh``: network namespaces of this machine, veth links, each host's own
disk at ``STATE/local``).

1. ``--sync`` of a 100 MB working directory (10 files of random bytes) to 1, 4 and 8 hosts at once
   (``launcher.schedulers.ssh.copies.sync``: rsync over the job's ssh settings), into a fresh directory
   each time: seconds and MB/s per host.
2. The checkpoint copy of a 2-host job of the built-in trainer (``--preset tiny``, a checkpoint every
   5 steps): the launcher's own line per copy (seconds, MB/s), and the training stall, side by side:
   the same job with its run dir on each host's own disk (the copies run) and on a directory every
   host sees (none run), interleaved round by round. The step time is the trainer's ``tokens_per_s``
   (median over a job's steps after the first 3), compared as a ratio of the medians.

Needs root and the dev hosts up (``bash deploy/ssh/dev-hosts.sh up --hosts 8``).
Usage: ``python benchmarks/bench_copies.py [--rounds R] [--steps N]``. Markdown to stdout, progress
on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from common import DEFAULT_TEXT, forget_own_disk, own_disk

from launcher.schedulers.ssh.copies import sync
from launcher.schedulers.ssh.options import SshOptions

STATE = Path(os.environ.get("GPTLAUNCH_SSH_STATE", "/var/lib/gptlaunch-ssh"))
HOSTS = [f"gl-h{k}" for k in range(1, 9)]
COPY = re.compile(r"checkpoint copy: \S+: \d+ file\(s\), ([\d.]+) MB in ([\d.]+) s")


def _private() -> Path:
    """A directory this machine and each host see on a disk of its own (``own_disk``)."""
    return own_disk(STATE, f"bench-{uuid.uuid4().hex[:8]}")


def bench_sync(source: Path) -> list[str]:
    rows = ["| hosts | seconds | MB/s per host |", "| ---: | ---: | ---: |"]
    size = sum(p.stat().st_size for p in source.iterdir()) / 1e6
    for n in (1, 4, 8):
        dest = _private()
        try:
            started = time.monotonic()
            sync(SshOptions(hosts=HOSTS[:n], sync=source), HOSTS[:n], str(dest / "work"), lambda _line: None)
            took = time.monotonic() - started
        finally:
            forget_own_disk(STATE, dest)
        rows.append(f"| {n} | {took:.2f} | {size / took:.0f} |")
        print(f"sync of {size:.0f} MB to {n} host(s): {took:.2f} s", file=sys.stderr)
    return rows


def run_job(root: Path, steps: int) -> tuple[float, list[tuple[float, float]]]:
    """A 2-host job with its record and run dir under ``root``: (median tokens/s, the copies)."""
    hostfile = root / "hosts"
    hostfile.write_text("gl-h1\ngl-h2\n")
    argv = [
        sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(root / "jobs"), "submit",
        "--scheduler", "ssh", "--hostfile", str(hostfile), "--nodes", "2", "--",
        "--no-compile", "--preset", "tiny", "--text-files", str(DEFAULT_TEXT), "--log-interval", "1",
        "--max-steps", str(steps), "--checkpoint-interval", "5", "--eval-interval", "100000",
        "--run-dir", str(root / "run"),
    ]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, timeout=1800)
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 3]
    (job,) = (root / "jobs").iterdir()
    copies = [(float(mb), float(s)) for mb, s in COPY.findall((job / "supervisor.log").read_text())]
    return statistics.median(speeds), copies


def bench_copy(rounds: int, steps: int) -> list[str]:
    speeds: dict[str, list[float]] = {"copies": [], "shared": []}
    copies: list[tuple[float, float]] = []
    for r in range(rounds):
        for side in ("copies", "shared") if r % 2 == 0 else ("shared", "copies"):
            root = _private() if side == "copies" else Path(tempfile.mkdtemp(prefix="bench-copies-"))
            try:
                speed, found = run_job(root, steps)
            finally:
                if side == "copies":
                    forget_own_disk(STATE, root)
                else:
                    shutil.rmtree(root, ignore_errors=True)
            speeds[side].append(speed)
            copies += [c for c in found if c[0] > 1]  # the checkpoints' copies, not the first (the data)
            print(f"round {r + 1}: {side}: {speed:,.0f} tokens/s, {len(found)} copies", file=sys.stderr)
    shared, copied = statistics.median(speeds["shared"]), statistics.median(speeds["copies"])
    seconds = statistics.median(s for _, s in copies)
    mb = statistics.median(m for m, _ in copies)
    return [
        "| | value |",
        "| --- | ---: |",
        f"| checkpoint size | {mb:.1f} MB |",
        f"| copy time per checkpoint (median of {len(copies)}) | {seconds:.2f} s |",
        f"| copy rate | {mb / seconds:.0f} MB/s |",
        f"| tokens/s, run dir shared (no copies) | {shared:,.0f} |",
        f"| tokens/s, run dir on each host's own disk (copies) | {copied:,.0f} |",
        f"| ratio copies / shared | {copied / shared:.3f} |",
        f"| spread of the shared rounds | {(max(speeds['shared']) - min(speeds['shared'])) / shared:.1%} |",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp)
        for k in range(10):
            (source / f"blob-{k}.bin").write_bytes(os.urandom(10_000_000))
        print("## `--sync` of a 100 MB working directory\n")
        print("\n".join(bench_sync(source)))
    print(f"\n## The checkpoint copy ({args.rounds} rounds, {args.steps} steps a job)\n")
    print("\n".join(bench_copy(args.rounds, args.steps)))


if __name__ == "__main__":
    main()
