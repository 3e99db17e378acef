"""Collectives of ``gptlaunch.snapshots`` over the job's own process group: objects gathered and
broadcast (pickled), and a training state broadcast with its tensors sent as tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def distributed() -> bool:
    """Whether this process is in an initialized process group."""
    return dist.is_available() and dist.is_initialized()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` outside a process group."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int) -> Any:
    """Rank ``src``'s ``obj`` (picklable) on every rank; ``obj`` outside a process group."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# What every process-group backend broadcasts (gloo has no bool); tensors of other dtypes are pickled.
_SENT_AS_TENSORS = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
}


@dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th broadcast tensor of a state goes, and its shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor that is sent as one replaced by its ``_Slot`` (appended to
    ``tensors``, in order)."""
    if isinstance(value, torch.Tensor) and value.dtype in _SENT_AS_TENSORS:
        tensors.append(value.contiguous())
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _split(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_split(v, tensors) for v in value)
    return value


def _join(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``_split``'s inverse: each ``_Slot`` of ``value`` replaced by its tensor."""
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_join(v, tensors) for v in value)
    return value


def _slots(value: Any) -> list[_Slot]:
    """The ``_Slot``s in ``value``."""
    if isinstance(value, _Slot):
        return [value]
    if isinstance(value, dict):
        return [slot for v in value.values() for slot in _slots(v)]
    if isinstance(value, list | tuple):
        return [slot for v in value for slot in _slots(v)]
    return []


def broadcast_state(state: Any, src: int) -> Any:
    """Rank ``src``'s ``state`` on every rank, its tensors on the CPU: its structure is pickled, its
    tensors are broadcast as tensors (pickling them cost about 1 s for 72 MB; NCCL sends them from the
    current GPU). Anything else (why there is none) is broadcast as it is."""
    if not distributed():
        return state
    tensors: list[torch.Tensor] = []
    structure = broadcast_object(_split(state, tensors) if dist.get_rank() == src else None, src)
    slots = sorted(_slots(structure), key=lambda slot: slot.index)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    received = []
    for slot in slots:
        if dist.get_rank() == src:
            tensor = tensors[slot.index]
            dist.broadcast(tensor.to(device) if device is not None else tensor, src)
        else:
            tensor = torch.empty(slot.shape, dtype=slot.dtype, device=device or "cpu")
            dist.broadcast(tensor, src)
            tensor = tensor.cpu()
        received.append(tensor)
    return _join(structure, received)
