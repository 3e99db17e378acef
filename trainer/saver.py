"""Checkpoints that do not stall training: rank 0 copies the state to host memory and a background
thread writes it.

The copy is torch's own ``DefaultStager`` (``gptlaunch.staging``): on CUDA into pinned host buffers
with a non-blocking copy, on the CPU into buffers of its own; it keeps the buffers from one save to
the next, so the copy allocates nothing after the first (not where torch's stager cannot be reused:
see there). The write is
``checkpoint.save`` as before (a temporary file, fsynced, renamed into place, the directory fsynced,
its sha256 hashed on this thread's way to the disk): a crash mid-write leaves the previous checkpoint
whole, and what a retry resumes is always complete.

One write at a time: a save that comes while the previous one is still writing waits for it (and
``SaveTimes.waited_s`` says how long), so no checkpoint is ever skipped. A blocking save (a stop on
SIGTERM/SIGUSR2, the last step, ``--no-async-checkpoints``) waits for any write in flight, then writes
before it returns: exit 75 always comes after a complete checkpoint on disk.

Why not ``torch.distributed.checkpoint.async_save``: it writes a directory of shards committed by its
``.metadata`` file, not one file renamed into place, and every reader of a checkpoint here (``--resume
PATH``, the stop marker, the launcher's copies of node-local run dirs, ``trainer sample``) reads one
file with ``torch.load(weights_only=True)``. Under DDP the state is the same on every rank, so its
sharding would not spread the write either: rank 0 would write it all, as here.

A checkpoint that does not fit on the run dir's file system (``NoSpaceError``, ``trainer.disk``)
does not end the run: training goes on, and the next save tries again, while a warning on the console
and in ``launcher status`` names the room it lacks and the newest whole checkpoint (cleared once a save
succeeds). The run's last save (its last step's, a stop's) must succeed: there it is the run's error.
Another failed background write raises its OSError at the next save, or when the run ends; a blocking
save (a stop's) is tried all the same, with a warning.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptlaunch import runtime
from gptlaunch.snapshots import tensor_bytes
from gptlaunch.staging import HostStager
from trainer import checkpoint
from trainer.console import warn
from trainer.errors import NoSpaceError

# Failure drill (as ``GPTLAUNCH_FAULT``): seconds each background write holds its temporary file open
# before the rename, as a slow disk would. The tests stop a run while a save is in flight with it.
SLOW_WRITE_ENV = "GPTLAUNCH_SLOW_CHECKPOINT_S"


@dataclass(frozen=True)
class SaveTimes:
    """What one save cost the training loop."""

    step: int
    path: Path  # where the checkpoint is (or will be, once a background write ends)
    stall_s: float  # seconds the loop waited: ``waited_s``, the copy, and (blocking) the write
    waited_s: float  # of ``stall_s``: seconds waiting for the previous save still writing
    nbytes: int  # bytes of tensors in the state
    background: bool  # the write goes on after ``save`` returned


class Saver:
    """Rank 0's checkpoint writer for ``run_dir``, keeping the newest ``keep`` checkpoints. A context
    manager: leaving it waits for the write in flight."""

    def __init__(self, run_dir: Path, keep: int, device: torch.device) -> None:
        self.run_dir, self.keep = run_dir, keep
        self._stager = HostStager(device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._writing: Future[Path | None] | None = None
        self.unsaved = 0  # saves in a row that did not fit on the run dir's file system

    def save(
        self, state: dict[str, Any], step: int, *, blocking: bool, last: bool = False
    ) -> SaveTimes | None:
        """Save ``state`` as the checkpoint of ``step``. Returns once it is copied to host memory (or,
        ``blocking``, written), with what it cost; None for a blocking save that did not fit.
        ``last``: the run's last save (it implies ``blocking``).

        Raises NoSpaceError when the ``last`` save does not fit (an earlier one that did not fit is a
        warning: ``_write``); OSError when the previous background write failed otherwise, or this
        blocking one (a blocking save is tried all the same after the previous write failed, with a
        warning: the checkpoint of a stop must not be lost to an earlier one)."""
        t0 = time.perf_counter()
        try:
            self.wait()
        except OSError as e:
            if not blocking:
                raise
            warn(f"the checkpoint written before this one failed: {e}")
        waited = time.perf_counter() - t0
        nbytes = tensor_bytes(state)
        if blocking:
            if self._write(state, step, last=last) is None:
                return None  # it did not fit (said): no checkpoint to account for
        else:
            staged = self._stager.stage(state)
            hold_s = float(os.environ.get(SLOW_WRITE_ENV) or 0)
            self._writing = self._pool.submit(self._write, staged, step, hold_s=hold_s)
        path = checkpoint.checkpoint_path(self.run_dir, step)
        stall = time.perf_counter() - t0
        return SaveTimes(step, path, stall, waited, nbytes, background=not blocking)

    def in_flight(self) -> bool:
        """Whether a background write is still going on."""
        return self._writing is not None and not self._writing.done()

    def wait(self) -> Path | None:
        """Wait for the write in flight, if any. Returns its checkpoint's path (None when there was
        none, or it did not fit); raises its OSError."""
        writing, self._writing = self._writing, None
        return writing.result() if writing is not None else None

    def _write(
        self, state: dict[str, Any], step: int, *, last: bool = False, hold_s: float = 0.0
    ) -> Path | None:
        """Write the checkpoint of ``step``: its path, or None when it did not fit on the run dir's
        file system and it is not the ``last``: training goes on, said at once on the console and in
        ``status`` until a save fits. Raises the ``last`` one's NoSpaceError, the write's OSError."""
        try:
            path = checkpoint.save(state, self.run_dir, step, self.keep, hold_s=hold_s)
        except NoSpaceError as e:
            if last:
                raise NoSpaceError(f"{e}; {self._newest()}") from None
            self.unsaved += 1
            said = f"{e}; not saved, training goes on and the next save tries again; {self._newest()}"
            runtime.warn(said, topic="checkpoint")
            return None
        if self.unsaved:  # the warning of a checkpoint that did not fit is moot now
            self.unsaved = 0
            runtime.warn(None, topic="checkpoint")
        return path

    def _newest(self) -> str:
        found = checkpoint.list_checkpoints(self.run_dir)
        return f"the newest whole checkpoint is {found[-1]}" if found else "no checkpoint is saved yet"

    def close(self) -> None:
        """Wait for the write in flight, then end the writer thread. Raises that write's OSError."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._stager.close()

    def __enter__(self) -> Saver:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()  # a failed write is this run's error
            return
        with contextlib.suppress(OSError):  # the run's own error comes first
            self.close()  # a complete checkpoint, or none: never half of one
