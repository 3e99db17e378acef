"""What the shim costs a user's script per optimizer step: the same training loop run bare (``python
loop.py``) and through ``python -m gptlaunch.shim loop.py`` with the launcher's watch on (a heartbeat
after every optimizer step through torch's global step hook, the flight recorder and its server),
interleaved round by round, one thread each; then the watch's own work per step, timed in one
process (the forward clock's hooks, the beat), which no run-to-run noise hides.

The loop (a 2-layer MLP, batch 64, AdamW; about 1 ms a step on these CPUs: small, so that a per-step
cost shows) times its own steps after a warm-up and prints milliseconds per step; the report is the
median over rounds of each side and their ratio (goal: within noise, a ratio of 1.00 ± the spread of
the bare rounds).

Usage: ``python benchmarks/bench_shim.py [--rounds R] [--steps N]``. Markdown to stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gptlaunch.contract import HEARTBEAT_DIR_ENV, JOB_ID_ENV

LOOP = """
import sys, time
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 256), torch.randn(64, 256)
steps, warmup = int(sys.argv[1]), 50
for i in range(warmup + steps):
    if i == warmup:
        start = time.perf_counter()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
print((time.perf_counter() - start) / steps * 1e3)
"""


def ms_per_step(script: Path, steps: int, shim: bool, beats: Path) -> float:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(script), str(steps)]
    if shim:
        env |= {JOB_ID_ENV: "bench", HEARTBEAT_DIR_ENV: str(beats), "RANK": "0"}
        argv = [sys.executable, "-m", "gptlaunch.shim", str(script), str(steps)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=600).stdout
    return float(out.split()[-1])


# The watch's own work, timed in one process (no noise from another run): a forward of the model the
# clock found against one of a model without hooks, and the optimizer-step hook's beat.
DIRECT = """
import time, torch
from gptlaunch import runtime
runtime.watch()
model, plain, x = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.ones(1, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
model(x).sum().backward()
opt.step()  # the clock has found ``model``; ``plain`` has no hook


def per_call_us(fn, n=20000):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


rounds = [(per_call_us(lambda: model(x)), per_call_us(lambda: plain(x))) for _ in range(5)]
hooked, bare = min(r[0] for r in rounds), min(r[1] for r in rounds)
print(hooked - bare, per_call_us(lambda: runtime._step_done(None)))
"""


def direct_cost_us(beats: Path) -> tuple[float, float]:
    """(µs the forward clock adds to a forward, torch's hook dispatch included; µs of a beat per
    optimizer step)."""
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "RANK": "0",
        JOB_ID_ENV: "bench",
        HEARTBEAT_DIR_ENV: str(beats),
    }
    argv = [sys.executable, "-c", DIRECT]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=600).stdout
    hooks, beat = (float(v) for v in out.split()[-2:])
    return hooks, beat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "loop.py"
        script.write_text(LOOP)
        bare: list[float] = []
        shimmed: list[float] = []
        for r in range(args.rounds):
            bare.append(ms_per_step(script, args.steps, False, Path(tmp) / "beats"))
            shimmed.append(ms_per_step(script, args.steps, True, Path(tmp) / "beats"))
            print(f"round {r + 1}: bare {bare[-1]:.3f} ms, shim {shimmed[-1]:.3f} ms", file=sys.stderr)
    b, s = statistics.median(bare), statistics.median(shimmed)
    spread = (max(bare) - min(bare)) / b
    print("| run | ms/step (median) | rounds |\n| --- | ---: | ---: |")
    print(f"| bare `python loop.py` | {b:.3f} | {args.rounds} |")
    print(f"| `python -m gptlaunch.shim loop.py`, watched | {s:.3f} | {args.rounds} |")
    print(f"\nshim / bare: {s / b:.3f} (bare rounds spread {spread:.1%}; {args.steps} steps a round)")
    with tempfile.TemporaryDirectory() as tmp:
        hooks, beat = direct_cost_us(Path(tmp) / "beats")
    print(
        f"the watch's own work, timed in one process: {hooks:.2f} µs added to each forward by the clock, "
        f"{beat:.2f} µs per optimizer-step beat ({(hooks + beat) / 1e3 / b:.2%} of a bare step)"
    )


if __name__ == "__main__":
    main()
