"""Process-group set-up from the standard torchrun environment.

The trainer knows nothing about the launcher: it reads RANK, LOCAL_RANK, WORLD_SIZE (and torchrun's
MASTER_ADDR/MASTER_PORT through ``init_method="env://"``), so bare ``torchrun`` or ``srun`` work too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_env() -> DistEnv:
    """Read RANK/LOCAL_RANK/WORLD_SIZE as set by torchrun; a plain ``python`` run is rank 0 of 1."""
    return DistEnv(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


def pick_device(spec: str, env: DistEnv) -> torch.device:
    """``auto`` -> this rank's GPU (``cuda:LOCAL_RANK``) when CUDA is available, else the CPU.

    Raises ConfigError when CUDA is requested but not available.
    """
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but CUDA is not available: use --device cpu")
        device = torch.device(spec if ":" in spec else f"cuda:{env.local_rank}")
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def pick_backend(spec: str, device: torch.device) -> str:
    """nccl for CUDA tensors, gloo for CPU tensors, unless overridden."""
    if spec != "auto":
        return spec
    return "nccl" if device.type == "cuda" else "gloo"


def init(env: DistEnv, backend: str, timeout_s: float) -> None:
    """Join the process group (no-op for a single process). ``timeout_s`` bounds every collective, so
    a dead peer turns into an error instead of a hang."""
    if env.is_distributed and not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
        )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over all ranks (identity for one process); returns ``t``."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of a same-shaped tensor, in rank order."""
    if not dist.is_initialized():
        return [t.clone()]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (picklable) on every rank; identity for one process. Collective."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` for one process. Collective."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
