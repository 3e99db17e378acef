"""Snapshots of the training state in host memory, every ``--snapshot-interval`` steps, so that a
failure costs at most that many steps instead of the steps since the last checkpoint on disk.

Under DDP every rank holds the same weights and optimizer state: each host already has the whole
state, and the only per-rank part, the random streams, is gathered at each snapshot (one small
all-gather). So one process per host (the lowest rank on it) keeps a snapshot in the host's shared
memory (``/dev/shm``), written in the background like a checkpoint (``trainer.saver``: a copy to
host memory, then a thread writes it; tmpfs, so no disk). It outlives the ranks' processes: when a
rank dies and the launcher starts the next attempt, the snapshot of every host that survived is
still there. The next attempt's ranks say which step each host holds; the newest, when it is newer
than the newest checkpoint on disk, is loaded by a rank on that host and broadcast over the job's
own process group to every rank, a spare host that replaced a lost one included (which is how a
spare gets the state when the hosts share no file system).

Where: ``gptlaunch.runtime.snapshot_dir``, one directory per job (the launcher's job id: the same for
every attempt of a job, another for the next submit) and run dir. A host keeps the snapshots of one
job per run dir: starting another drops the older ones, and a run that ends (succeeded, or stopped
with its checkpoint on disk) drops its own, the last attempt's included, which keeps none. A host
that the launcher lost drops its own (``launcher.agent.node``: a replaced host keeps nothing of the
job). A job that fails for good leaves one snapshot per host, the size of a checkpoint, which the
launcher removes on the local scheduler; elsewhere it stays until the next run of that run dir on that
host, or a reboot.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptlaunch import runtime
from trainer import checkpoint, distributed
from trainer.console import warn
from trainer.errors import CheckpointError
from trainer.saver import Saver, tensor_bytes

SHM = Path("/dev/shm")


HEADROOM_BYTES = 256 * 2**20  # left free in shared memory after a snapshot (NCCL uses it too)


class Snapshots:
    """This host's snapshots, kept by its lowest rank in ``directory`` (one at a time; none when not
    ``keeping``: the other jobs' of the run dir are still dropped). Best effort: a snapshot that does
    not fit in shared memory, or whose write fails, is a warning and turns snapshots off for the run;
    the checkpoints on disk go on. A context manager: leaving it waits for the write in flight."""

    def __init__(self, directory: Path, device: torch.device, keeping: bool = True) -> None:
        self.directory = directory
        self._saver: Saver | None = None
        try:
            drop_others(directory)
            if not keeping:
                return
            runtime.SNAPSHOT_ROOT.mkdir(mode=0o700, exist_ok=True)  # this user's only
            checkpoint.remove_partial_saves(directory)
        except OSError as e:
            warn(f"no snapshots in memory for this run: {e}")
            return
        self._saver = Saver(directory, 1, device)

    def keep(self, state: dict[str, Any], step: int) -> None:
        """Snapshot ``state`` as the one of ``step``, written in the background."""
        if self._saver is None:
            return
        try:
            needed, free = tensor_bytes(state) + HEADROOM_BYTES, _free_bytes(self.directory)
            if needed > free:
                return self._off(f"{needed / 1e6:.0f} MB needed, {free / 1e6:.0f} MB free in {SHM}")
            self._saver.save(state, step, blocking=False)
        except Exception as e:  # best effort: the previous write failed, no room, no permission
            self._off(str(e))

    def _off(self, why: str) -> None:
        warn(
            f"no more snapshots in memory for this run ({why}): a retry resumes from the last checkpoint "
            "on disk (in a container, a larger --shm-size makes room)"
        )
        saver, self._saver = self._saver, None
        if saver is not None:
            with contextlib.suppress(OSError):  # said above
                saver.close()

    def __enter__(self) -> Snapshots:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saver is not None:
            try:
                self._saver.close()
            except OSError as e:
                self._saver = None
                warn(f"the last snapshot in memory could not be written: {e}")


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (its nearest existing ancestor)."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


@dataclass(frozen=True)
class Offer:
    """What one rank can give at a resume: its host and the step of that host's snapshot (None)."""

    host: str
    step: int | None


def my_offer(directory: Path) -> Offer:
    """This host's snapshot (its step None when there is none, or it cannot be read)."""
    try:
        found = checkpoint.list_checkpoints(directory)
    except OSError:
        found = []
    return Offer(socket.gethostname(), checkpoint.step_of(found[-1]) if found else None)


def writers(hosts: list[str]) -> set[int]:
    """The ranks that keep their host's snapshot: the lowest rank on each host, given every rank's
    host in rank order."""
    first: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        first.setdefault(host, rank)
    return set(first.values())


def source(offers: list[Offer], disk_step: int | None) -> tuple[int, int] | None:
    """(the rank that loads and broadcasts, the step) of the newest snapshot, given every rank's
    offer in rank order, when it is newer than the newest checkpoint on disk (``disk_step``); None
    when the disk has the newest (or nobody has a snapshot)."""
    held = [(o.step, -rank) for rank, o in enumerate(offers) if o.step is not None]
    if not held:
        return None
    step, neg_rank = max(held)  # the newest; among equals, the lowest rank
    if disk_step is not None and disk_step >= step:
        return None
    return -neg_rank, step


def drop_others(directory: Path) -> None:
    """Remove this host's snapshots of the same run dir by other jobs (``directory``'s name is the run
    dir's key, its parent the job's)."""
    for other in directory.parent.parent.glob(f"*/{directory.name}"):
        if other != directory:
            drop(other)


def drop(directory: Path) -> None:
    """Remove a run's snapshots on this host, and its job's directory once empty."""
    shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):
        directory.parent.rmdir()  # only when empty


def from_memory(directory: Path, rank: int, disk_step: int | None) -> tuple[dict[str, Any], str] | None:
    """The newest snapshot of any host, when newer than ``disk_step`` (the newest checkpoint on disk),
    on every rank, with where it came from in words; None otherwise. Collective: the rank on the
    chosen host loads it and broadcasts it. A snapshot that cannot be read is skipped with a warning
    (None: the disk's checkpoint is used)."""
    offers = distributed.all_gather_object(my_offer(directory))
    chosen = source(offers, disk_step)
    if chosen is None:
        return None
    src, step = chosen
    loaded: dict[str, Any] | str | None = None
    if rank == src:
        try:
            loaded = checkpoint.load(checkpoint.checkpoint_path(directory, step))
        except CheckpointError as e:
            loaded = str(e)
    loaded = distributed.broadcast_object(loaded, src=src)
    if isinstance(loaded, str):
        if rank == 0:
            warn(f"the snapshot of step {step} in {offers[src].host}'s memory cannot be read: {loaded}")
        return None
    return loaded, f"the snapshot in {offers[src].host}'s memory"
