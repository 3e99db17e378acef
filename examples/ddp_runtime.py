"""``ddp_plain.py`` with the launcher's runtime API (``gptlaunch.runtime``): a few lines more, and it
checkpoints where the job's checkpoints go, resumes on a retry by itself, and answers a cancel, a
preemption or a time limit by checkpointing and exiting 75 (resume by submitting again)::

    launcher submit --nodes 2 --retries 1 -- examples/ddp_runtime.py --data input.txt --steps 200

Under bare torchrun it behaves as ``ddp_plain.py`` does: every runtime call is inert there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ddp_plain import batches, build, load, parse_args, save, setup, train_step

from gptlaunch import runtime


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
    runtime.resumed_from(step)
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
            if step == args.steps:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
