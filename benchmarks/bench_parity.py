"""Parity-check fan-out: `launcher check` over N SSH test hosts against 1 host, side by side.

The hosts are the network namespaces of deploy/ssh/dev-hosts.sh (needs root); runs of 1 and N hosts
alternate, so load from other processes hits both alike. Prints the wall time of the probes (the
`probe_s` that `launcher check --json` reports) and the ratio N ÷ 1 (goal: ≤ 1.5 on real hosts; here
all hosts share this machine's cores, so the floor is about N ÷ cores).

    python benchmarks/bench_parity.py [--hosts 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def check_s(hostfile: Path) -> float:
    """Seconds `launcher check` took to probe every host of ``hostfile`` in parallel."""
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli.main", "check", "--hostfile", str(hostfile), "--json"],
        capture_output=True, text=True, check=True, cwd=REPO_ROOT,
    ).stdout  # fmt: skip
    return float(json.loads(out)["probe_s"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=16, help="hosts of the fan-out (default: 16)")
    p.add_argument("--rounds", type=int, default=5, help="alternating pairs of runs (default: 5)")
    args = p.parse_args()
    up = subprocess.run(
        ["bash", str(REPO_ROOT / "deploy/ssh/dev-hosts.sh"), "up", "--hosts", str(args.hosts)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = [x for x in Path(up.stdout.split()[-1]).read_text().splitlines() if x and x[0] != "#"]
    with tempfile.TemporaryDirectory() as tmp:
        one, many = Path(tmp, "one"), Path(tmp, "many")
        one.write_text(lines[0] + "\n")
        many.write_text("\n".join(lines[: args.hosts]) + "\n")
        check_s(many)  # warm-up: ssh master connections, page cache
        pairs = [(check_s(one), check_s(many)) for _ in range(args.rounds)]
    t1 = statistics.median(a for a, _ in pairs)
    tn = statistics.median(b for _, b in pairs)
    print(f"{'hosts':>6} {'probe wall s (median)':>22} {'ratio':>6}")
    print(f"{1:>6} {t1:>22.2f} {1.0:>6.2f}")
    print(f"{args.hosts:>6} {tn:>22.2f} {tn / t1:>6.2f}")
    print(f"rounds {args.rounds}; per-round ratios: {', '.join(f'{b / a:.2f}' for a, b in pairs)}; "
          f"{os.cpu_count()} cores shared by all hosts")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
