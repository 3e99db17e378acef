"""``ddp_plain.py`` with the launcher's runtime API (``gptlaunch.runtime``): a few lines more, and it
checkpoints where the job's checkpoints go, resumes on a retry by itself, and answers a cancel, a
preemption or a time limit by checkpointing and exiting 75 (resume by submitting again). With
``--retries`` it also keeps a snapshot in each host's memory every 10 steps (``gptlaunch.snapshots``),
so a retry goes on from there rather than from the last checkpoint::

    launcher submit --nodes 2 --retries 1 -- examples/ddp_runtime.py --data input.txt --steps 200

Under bare torchrun it behaves as ``ddp_plain.py`` does: every runtime call is inert there, and
snapshots are kept only with torchrun's ``--max-restarts``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from ddp_plain import batches, build, load, parse_args, save, setup, train_step

from gptlaunch import runtime
from gptlaunch.snapshots import Snapshots


def stop_agreed(device: torch.device) -> bool:
    """Whether any rank was asked to stop: all ranks stop at the same step (one all-reduce)."""
    flag = torch.tensor([int(runtime.stop_requested())], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main() -> None:
    args = parse_args()
    out = runtime.checkpoint_dir() or args.out
    device = setup()
    model, opt = build(args, device)
    step = load(out, model, opt) if runtime.resumed() or args.init_from == "resume" else 0
    with Snapshots(out, every=10, device=device) as snapshots:  # leaving it normally drops them
        found = snapshots.resume(newer_than=step)  # on a retry: a host's snapshot newer than the disk's
        if found is not None:
            state, where = found
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            step = int(state["step"])
            if dist.get_rank() == 0:
                print(f"resumed from {where} at step {step}", flush=True)
        runtime.resumed_from(step)
        train(args, out, model, opt, device, step, snapshots)
    del model, opt  # before the group: see ddp_plain.py (a hang at exit otherwise)
    dist.destroy_process_group()


def train(
    args: argparse.Namespace,
    out: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    device: torch.device,
    step: int,
    snapshots: Snapshots,
) -> None:
    sampler, loader = batches(args)
    epoch = 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = train_step(model, opt, x.to(device), y.to(device))
            step += 1
            if dist.get_rank() == 0 and step % 10 == 0:
                print(f"step {step}/{args.steps} loss {loss:.4f}", flush=True)
            if stop_agreed(device):
                runtime.exit_checkpointed(step, save(out, model, opt, step))
            if step % args.checkpoint_every == 0 or step == args.steps:
                save(out, model, opt, step)
            elif snapshots.due(step):
                snapshots.keep(step, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step})
            if step == args.steps:
                return
        epoch += 1


if __name__ == "__main__":
    main()
