"""What a checkpoint costs the training loop: a blocking save against a background one
(``trainer.saver``), side by side in one run, on this machine's disk.

For each preset, a GPT with its AdamW state after one step (as the trainer checkpoints it) is saved
``--rounds`` times each way, alternating, into a temporary directory on the ``--dir`` file system:

- blocking: ``checkpoint.save`` (written, fsynced and renamed before it returns): the loop's stall;
- background: ``Saver.save(blocking=False)``: the loop's stall is the copy to host memory; the write
  that follows is timed to its end, while the loop goes on with training steps (batch ``--batch``
  blocks of the preset's block size), whose times against steps with no write in flight give what the
  background write costs the steps around it (the CPU and the GIL are shared).

On ``--device cuda`` the model, its optimizer and the steps are on the GPU (fp32, eager): the
background save's stall is then the copy into pinned host buffers.

Usage: ``python benchmarks/bench_checkpoint.py [--presets tiny gpt2] [--rounds 3] [--dir DIR]
[--device cuda]``.
Progress goes to stderr, a Markdown table to stdout (medians over the rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from procs import log

from trainer import checkpoint
from trainer.config import PRESETS, TrainConfig
from trainer.model import GPT
from trainer.optim import make_optimizer
from trainer.saver import Saver

VOCAB = 8192  # the trainer's default tokenizer size


def _setup(preset: str, device: torch.device) -> tuple[GPT, torch.optim.Optimizer, TrainConfig]:
    cfg = TrainConfig(preset=preset)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = GPT(cfg.gpt_config(VOCAB)).to(device)
    return model, make_optimizer(model, cfg, device), cfg


def _step(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if x.is_cuda:  # the step's kernels are queued: wait for them, or the time is the launch's
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _state(model: GPT, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _preset(preset: str, rounds: int, batch: int, directory: Path, device: torch.device) -> dict[str, float]:
    model, optimizer, cfg = _setup(preset, device)
    x = torch.randint(0, VOCAB, (batch, cfg.block_size), device=device)
    quiet = [_step(model, optimizer, x) for _ in range(3)][1:]  # the first warms up
    blocking, stall, write, during = [], [], [], []
    with tempfile.TemporaryDirectory(dir=directory) as tmp, Saver(Path(tmp), 2, device) as saver:
        for r in range(rounds):
            t0 = time.perf_counter()
            checkpoint.save(_state(model, optimizer, 2 * r), Path(tmp), 2 * r, keep=2)
            blocking.append(time.perf_counter() - t0)
            quiet.append(_step(model, optimizer, x))
            t0 = time.perf_counter()
            times = saver.save(_state(model, optimizer, 2 * r + 1), 2 * r + 1, blocking=False)
            steps = []
            while saver.in_flight():
                steps.append(_step(model, optimizer, x))
            saver.wait()
            write.append(time.perf_counter() - t0)
            stall.append(times.stall_s)
            during += steps
            log(f"{preset} round {r + 1}: blocking {blocking[-1]:.3f} s, background stall {stall[-1]:.3f} s")
        size = times.nbytes
    med = statistics.median
    return {
        "mb": size / 1e6,
        "blocking": med(blocking),
        "stall": med(stall),
        "write": med(write),
        "slowdown": med(during) / med(quiet) if during else float("nan"),
        "steps": len(during) / rounds,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "gpt2"], choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="blocks per training step between saves")
    p.add_argument("--dir", type=Path, default=Path.cwd(), help="where the checkpoints are written")
    p.add_argument("--device", default="cpu", help="where the model and its steps are: cpu or cuda")
    a = p.parse_args()
    torch.set_num_threads(1)  # as one rank of a 2-rank job on these 2 cores
    print("| preset | state MB | blocking save, s | background: stall, s | stall / blocking | "
          "write to its end, s | steps during it | their step time / quiet |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for preset in a.presets:
        r = _preset(preset, a.rounds, a.batch, a.dir, torch.device(a.device))
        print(f"| {preset} | {r['mb']:.0f} | {r['blocking']:.3f} | {r['stall']:.3f} | "
              f"{r['stall'] / r['blocking']:.1%} | {r['write']:.3f} | {r['steps']:.1f} | "
              f"{r['slowdown']:.2f}× |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
