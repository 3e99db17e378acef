"""A training state broadcast over a real gloo process group of 2 processes (``gptlaunch.collectives``):
its tensors sent as tensors, whatever else pickled, and every value and container type as it was."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gptlaunch.collectives import broadcast_state


def _state() -> dict[str, object]:
    weight = torch.arange(12.0).reshape(3, 4)
    return {
        "model": {"w": weight.t(), "steps": torch.tensor(7.0), "mask": torch.tensor([True, False])},
        "rng": [torch.arange(5, dtype=torch.uint8), (torch.tensor([1, 2], dtype=torch.int64), "cpu")],
        "step": 30,
        "name": "tiny",
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and b.device.type == "cpu"
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    got = broadcast_state(_state() if rank == 1 else None, src=1)
    why = broadcast_state("no snapshot here" if rank == 1 else None, src=1)
    Path(out, f"rank{rank}").write_text(f"{_same(_state(), got)} {why}")
    os._exit(0)  # gloo's threads may abort a normal interpreter exit (see gptlaunch.exits)


def test_a_state_reaches_every_rank_whole(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["True no snapshot here"] * 2
