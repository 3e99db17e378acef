"""The copy of a training state to host memory that a background checkpoint or snapshot waits for:
torch's ``DefaultStager`` (``torch.distributed.checkpoint.staging``), synchronous. On CUDA into pinned
buffers with non-blocking copies, then a synchronize; on the CPU into buffers of its own. It keeps its
buffers from one copy to the next, so only the first allocates (and pins).

torch 2.11's ``DefaultStager`` cannot be reused: its copy closes the stager it holds, and the next copy
raises ``KeyError: <class 'type'>`` (pytorch/pytorch#183413, seen on a GPU machine with torch 2.11;
2.13 is fixed). Which releases and builds have it is not known for certain (NGC's ``2.11.0a0+...``
among them), so it is tried once per process, when the first stager is made, with two copies of a
one-element state on the CPU; where it fails, each copy gets a new stager, so each allocates and pins
its buffers anew.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


@functools.cache
def closes_itself() -> bool:
    """Whether this torch's ``DefaultStager`` fails at its second copy (pytorch/pytorch#183413)."""
    stager = DefaultStager(_options(cuda=False))
    try:
        for _ in range(2):
            stager.stage({"t": torch.zeros(1)})
    except KeyError:
        return True
    finally:
        stager.close()
    return False


def _options(cuda: bool) -> StagingOptions:
    """Synchronous copies; on CUDA into pinned buffers, non-blocking (then synchronized)."""
    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )


class HostStager:
    """Copies of states to host memory for ``device``'s tensors. ``stage`` returns the copy once it
    is complete: the state's tensors may change again at once."""

    def __init__(self, device: torch.device, reusable: bool | None = None) -> None:
        self._options = _options(device.type == "cuda")
        self._reusable = not closes_itself() if reusable is None else reusable
        self._stager = DefaultStager(self._options)

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` (nested dicts, lists and tuples of tensors and plain values) in host
        memory. A reused stager copies into the buffers of its previous copy: write that one out first."""
        staged = cast(dict[str, Any], self._stager.stage(state))  # synchronous staging: a dict
        if not self._reusable:
            self._stager.close()
            self._stager = DefaultStager(self._options)
        return staged

    def close(self) -> None:
        """Let go of the buffers kept for the next copy."""
        self._stager.close()
