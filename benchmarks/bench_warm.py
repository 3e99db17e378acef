"""What a rank's start costs cold and forked from a warm process (``gptlaunch.warm``), side by side.

A rank's program here does what the trainer does before its first step that does not depend on the
job: import torch, build a small GPT and its AdamW (whose first use imports ``torch._dynamo``). Each
pair starts it once as ``python PROGRAM`` (cold) and once through ``python -m gptlaunch.warm run``
with a zygote that has imported torch already (warm), alternating; the time is from the start of the
process until the program says it is ready.

Usage: ``python benchmarks/bench_warm.py [--pairs 5]``. Progress to stderr, Markdown to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procs import child_env, log

PROGRAM = """
import sys
import torch
from trainer.config import GPTConfig
from trainer.model import GPT
model = GPT(GPTConfig(vocab_size=512))
torch.optim.AdamW(model.parameters(), fused=True)
print("ready", flush=True)
"""


def _start(argv: list[str]) -> float:
    """Seconds from the start of ``argv`` until it printed ``ready``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=child_env(1))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - t0
    proc.wait(60)
    if "ready" not in line or proc.returncode != 0:
        raise SystemExit(f"bench: {argv} did not start: {line!r}, exit {proc.returncode}")
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        program, sock = Path(tmp) / "program.py", str(Path(tmp) / "z.sock")
        program.write_text(PROGRAM)
        zygote = subprocess.Popen(
            [sys.executable, "-m", "gptlaunch.warm", "serve", sock], stdout=subprocess.PIPE, text=True,
            env=child_env(1),
        )  # fmt: skip
        assert zygote.stdout is not None
        t0 = time.perf_counter()
        zygote.stdout.readline()
        log(f"zygote ready in {time.perf_counter() - t0:.2f} s")
        cold, warm = [], []
        try:
            for k in range(a.pairs):
                cold.append(_start([sys.executable, str(program)]))
                warm.append(_start([sys.executable, "-m", "gptlaunch.warm", "run", sock, "--", str(program)]))
                log(f"pair {k + 1}: cold {cold[-1]:.2f} s, warm {warm[-1]:.2f} s")
        finally:
            zygote.terminate()
            zygote.wait(10)
    med = statistics.median
    print("| start | seconds (median) | range |\n| --- | ---: | --- |")
    for name, xs in (("cold: `python PROGRAM`", cold), ("warm: forked from the zygote", warm)):
        print(f"| {name} | {med(xs):.2f} | {min(xs):.2f}–{max(xs):.2f} |")
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"\ncold / warm = **{med(cold) / med(warm):.1f}×** over {a.pairs} alternating pairs; {when} · "
          f"`python benchmarks/bench_warm.py --pairs {a.pairs}`")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
