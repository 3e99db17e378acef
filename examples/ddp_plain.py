"""A plain PyTorch DDP training script, as users bring them: it knows torchrun, not the launcher.

A byte-level language model (an MLP over the last CONTEXT bytes) trained on a text file, with a
``DistributedSampler``, checkpoints written by rank 0, and ``--init-from resume`` to continue from the
newest one (nanoGPT's ``--init_from=resume``). Run it with torchrun or with the launcher::

    torchrun --nproc-per-node 2 examples/ddp_plain.py --data input.txt --steps 200
    launcher submit --nodes 2 -- examples/ddp_plain.py --data input.txt --steps 200

Imports nothing of the launcher: under the launcher every optimizer step still beats (``gptlaunch.shim``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CONTEXT = 16  # bytes the model sees before the one it predicts


class Bytes(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(CONTEXT bytes, the next byte) windows of a file, every CONTEXT bytes."""

    def __init__(self, path: Path) -> None:
        self.data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()

    def __len__(self) -> int:
        return (len(self.data) - 1) // CONTEXT - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * CONTEXT
        return self.data[start : start + CONTEXT], self.data[start + CONTEXT]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="a text file to train on")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to train for")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--out", type=Path, default=Path("out"), help="checkpoint directory")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--init-from", choices=["scratch", "resume"], default="scratch")
    return p.parse_args(argv)


def setup() -> torch.device:
    """Join the process group from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Embedding(256, 32), nn.Flatten(), nn.Linear(32 * CONTEXT, 256), nn.GELU())
    model.append(nn.Linear(256, 256))
    model = DistributedDataParallel(model.to(device))
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def batches(args: argparse.Namespace) -> tuple[DistributedSampler[int], DataLoader[tuple]]:
    """This rank's share of the windows, reshuffled each epoch (``sampler.set_epoch``)."""
    dataset = Bytes(args.data)
    sampler = DistributedSampler(dataset, seed=0)
    return sampler, DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)


def save(out: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> Path:
    """Rank 0 writes ``out/ckpt.pt`` atomically (a temporary file renamed over it)."""
    path = out / "ckpt.pt"
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
        torch.save(state, out / "ckpt.pt.tmp")
        os.replace(out / "ckpt.pt.tmp", path)
    dist.barrier()  # no rank goes on (or exits) before the checkpoint is whole
    return path


def load(out: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The step of ``out/ckpt.pt``, its state loaded (0 when there is none)."""
    path = out / "ckpt.pt"
    if not path.is_file():
        return 0
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def main() -> None:
    args = parse_args()
    device = setup()
    model, opt = build(args, device)
    step = load(args.out, model, opt) if args.init_from == "resume" else 0
    if step and dist.get_rank() == 0:
        print(f"resumed from {args.out / 'ckpt.pt'} at step {step}", flush=True)
    sampler, loader = batches(args)
    epoch = 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = train_step(model, opt, x.to(device), y.to(device))
            step += 1
            if dist.get_rank() == 0 and step % 10 == 0:
                print(f"step {step}/{args.steps} loss {loss:.4f}", flush=True)
            if step % args.checkpoint_every == 0 or step == args.steps:
                save(args.out, model, opt, step)
            if step == args.steps:
                break
        epoch += 1
    # DDP's reducer holds the process group: drop it first. Destroyed after the group, it frees the
    # group holding the GIL while gloo's thread waits for the GIL: a hang at exit (pytorch/pytorch#56297).
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
