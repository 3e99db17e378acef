"""What a checkpoint's checksum costs: the save with and without its sha256, and its check on resume.

A state of ``--mb`` MB of float32 tensors (as a model's weights and AdamW state) is saved ``--rounds``
times each way, alternating, into a temporary directory on the ``--dir`` file system:

- plain: ``atomic_write`` + ``torch.save`` (a temporary file, fsynced, renamed into place), as before;
- checked: ``checkpoint.save``, which hashes the bytes as they are written and writes ``.sha256``.

Then the check a resume makes before loading (``checkpoint.examine``: one read of the file, hashed),
next to the ``torch.load`` that follows it. Medians over the rounds, in milliseconds.

Usage: ``python benchmarks/bench_checksum.py [--mb 50] [--rounds 7] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gptlaunch.files import atomic_write
from trainer import checkpoint


def _round(state: dict, run_dir: Path, step: int) -> dict[str, float]:
    """One save each way, then the check and the load of the checked one, in milliseconds."""
    t0 = time.perf_counter()
    with atomic_write(run_dir / "plain.pt") as f:
        torch.save(state, f)
    t1 = time.perf_counter()
    path = checkpoint.save(state, run_dir, step, keep=1)
    t2 = time.perf_counter()
    checkpoint.examine(path)
    t3 = time.perf_counter()
    checkpoint.load(path, examined=True)
    t4 = time.perf_counter()
    ms = {"plain": t1 - t0, "checked": t2 - t1, "examine": t3 - t2, "load": t4 - t3}
    return {k: v * 1000 for k, v in ms.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=50.0, help="size of the state's tensors, MB")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dir", type=Path, default=Path.cwd(), help="where the checkpoints are written")
    a = p.parse_args()
    n = int(a.mb * 1e6 / 4 / 3)  # weights, Adam's two moments
    state = {
        "format": checkpoint.FORMAT_VERSION,
        "step": 1,
        "model": {"w": torch.randn(n)},
        "optimizer": {"m": torch.randn(n), "v": torch.rand(n)},
    }
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        rounds = [_round(state, Path(tmp), r) for r in range(a.rounds)]
        size = checkpoint.list_checkpoints(Path(tmp))[-1].stat().st_size / 1e6
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print("| file MB | save, ms | save + sha256, ms | overhead | check on resume, ms | torch.load, ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {size:.1f} | {med['plain']:.0f} | {med['checked']:.0f} | "
        f"{med['checked'] / med['plain'] - 1:+.0%} | {med['examine']:.0f} | {med['load']:.0f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
