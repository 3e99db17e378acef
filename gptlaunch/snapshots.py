"""Snapshots of a run's training state in each host's memory, so that a failure costs the steps since
the last snapshot (every 10 by default) instead of the steps since the last checkpoint on disk. Part
of the public runtime API (``gptlaunch.runtime`` is the rest); unlike it, this module imports torch.

Under data parallelism (DDP) every rank holds the same weights and optimizer state, so every host
already has all of it. One process per host (the lowest rank on it) writes a snapshot into the host's
shared memory (``/dev/shm``: memory, no disk) in the background; the caller waits only for the copy to
host memory (torch's ``DefaultStager``: pinned and non-blocking on CUDA). ``/dev/shm`` outlives the
ranks: when a rank dies and the launcher starts the next attempt, every surviving host still holds
its snapshot. ``Snapshots.resume`` asks every rank which step its host holds; the newest, when newer
than the caller's checkpoint on disk, is loaded by a rank on that host and broadcast over the job's
process group to every rank, a spare that replaced a lost host included (which is how it gets the
state when the hosts share no file system). What differs between ranks (their random streams) is the
caller's to gather into the state it keeps.

Snapshots are kept only when a retry can use them (``runtime.may_retry``: the launcher's ``--retries``
not used up, or torchrun's ``--max-restarts``), and read only by a retry (``runtime.retried``): a new
run never resumes from an earlier run's. Best effort: a snapshot that does not fit in shared memory,
or whose write fails, is a warning and turns snapshots off for the run. One snapshot per host, job
and run dir (``runtime.snapshot_dir``): a new job on the same run dir drops the older job's, and a
run that ends (leaving the ``with`` block normally, or through exit 0 or 75) drops its own; an
exception keeps it for the retry.

A state holds what ``torch.load(weights_only=True)`` reads back: tensors, and dicts, lists and tuples
of them and of plain values (int, float, str, bool, None), as model and optimizer state dicts and
``torch.get_rng_state()`` are; not numpy arrays or objects of your own classes. On a GPU, call
``torch.cuda.set_device`` first: the gathers and the broadcast go through the current device.

A script opts in with a few lines::

    with Snapshots(out) as snapshots:  # collective
        found = snapshots.resume(newer_than=step)  # collective: (state, where) or None
        if found is not None:
            state, where = found
            ...  # load it, as a checkpoint
        try:
            for ...:
                ...  # one optimizer step; ``step``: the steps done
                if snapshots.due(step):
                    snapshots.keep(step, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step})
        except Exception:  # optional: a retry then redoes no step after a lost peer
            snapshots.keep_last(step, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step})
            raise

``keep_last`` is for a state that is whole: ``step`` must be the steps the weights hold, which is not
so for an error raised inside the optimizer's step (the built-in trainer tracks it: ``trainer.run``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptlaunch import runtime
from gptlaunch.collectives import all_gather_object, broadcast_state, distributed
from gptlaunch.files import atomic_write_checked, check_digest, digest_path, free_bytes
from gptlaunch.staging import HostStager

SHM = Path("/dev/shm")
HEADROOM_BYTES = 256 * 2**20  # left free in shared memory after a snapshot (NCCL uses it too)
_FILE = re.compile(r"snapshot-(\d{8,})\.pt")


@dataclass(frozen=True)
class Offer:
    """What one rank can give at a resume: its host and the step of that host's snapshot (None)."""

    host: str
    step: int | None
    retried: bool = False  # this rank's attempt follows a failed one (``runtime.retried``)


class Snapshots:
    """A run's snapshots in this host's memory, on every rank of the run: kept by the lowest rank of
    each host, read by all. Created on every rank (collective: it gathers each rank's host, unless
    given ``hosts``, every rank's in rank order). ``run_dir``: the run's checkpoint directory, which
    names the run; ``every``: steps between snapshots (0: none); ``device``: where the state lives
    (pinned host buffers for CUDA). A context manager: leaving it waits for the write in flight, and
    drops this host's snapshots when the run ended (no exception, or exit 0 or 75)."""

    def __init__(
        self,
        run_dir: Path | str,
        every: int = 10,
        device: torch.device | None = None,
        hosts: list[str] | None = None,
    ) -> None:
        if not distributed() and int(os.environ.get("WORLD_SIZE") or 1) > 1:
            raise RuntimeError("Snapshots needs the process group: call init_process_group first")
        self.directory = runtime.snapshot_dir(Path(run_dir))
        self.every = every
        self.rank = dist.get_rank() if distributed() else 0
        hosts = hosts if hosts is not None else all_gather_object(socket.gethostname())
        self.writer = self.rank in writers(hosts) and SHM.is_dir()
        self._pool: ThreadPoolExecutor | None = None
        self._writing: Future[None] | None = None
        if self.writer and every > 0 and runtime.may_retry():
            self._start(device or torch.device("cpu"))
        elif self.writer:
            with contextlib.suppress(OSError):
                drop_others(self.directory)

    def _start(self, device: torch.device) -> None:
        try:
            drop_others(self.directory)
            if not runtime.retried():  # a run that is not a retry reads none (bare torchrun reuses ids)
                drop(self.directory)
            runtime.SNAPSHOT_ROOT.mkdir(mode=0o700, exist_ok=True)  # this user's only
            self.directory.mkdir(parents=True, exist_ok=True)
            for partial in self.directory.glob("*.tmp"):  # a writer killed mid-write
                partial.unlink()
        except OSError as e:
            return _warn(f"no snapshots in memory for this run: {e}")
        self._stager = HostStager(device)  # keeps its buffers from one snapshot to the next
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")

    def due(self, step: int) -> bool:
        """Whether ``step`` (steps done) is one to snapshot."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def keep(self, step: int, state: dict[str, Any]) -> None:
        """On this host's keeper, snapshot ``state`` (tensors, and dicts, lists and tuples of them and
        of plain values: see the module docstring) as the one of ``step``: returns once it is copied to host
        memory, after waiting for the previous write. A no-op on the other ranks."""
        if self._pool is None:
            return
        try:
            self._wait()
            needed, free = tensor_bytes(state) + HEADROOM_BYTES, free_bytes(self.directory)
            if needed > free:
                return self._off(f"{needed / 1e6:.0f} MB needed, {free / 1e6:.0f} MB free in {SHM}")
            staged = self._stager.stage(state)
            self._writing = self._pool.submit(self._write, staged, step)
        except Exception as e:  # best effort: the previous write failed, no room, no permission
            self._off(str(e))

    def keep_last(self, step: int, state: dict[str, Any]) -> bool:
        """On this host's keeper, on the way out of a failure: write ``state`` as the snapshot of
        ``step`` before returning, with no collective (a peer may be gone), after the write in flight.
        A rank that survived a lost peer holds the newest state, and a retry resumes from it instead
        of redoing the steps since the last snapshot. Returns whether it was written (False on the
        other ranks, with snapshots off, or when there is no room or the write failed: a warning).
        Give it CPU tensors: after a failed collective a GPU's stream may never drain."""
        if self._pool is None:
            return False
        with contextlib.suppress(Exception):  # an older snapshot's failed write: moot now
            self._wait()
        try:
            needed, free = tensor_bytes(state) + HEADROOM_BYTES, free_bytes(self.directory)
            if needed > free:  # the older snapshot stays until this one is whole: room for both
                raise OSError(f"{needed / 1e6:.0f} MB needed, {free / 1e6:.0f} MB free in {SHM}")
            self._write(state, step)
        except Exception as e:
            _warn(f"the state of step {step} could not be kept in memory: {e}")
            return False
        return True

    def _write(self, staged: dict[str, Any], step: int) -> None:
        path = self.directory / f"snapshot-{step:08d}.pt"
        # A reader sees the whole snapshot or none; a failed write leaves none. Its sha256, hashed as
        # it is written, lets the reader find one changed since (``resume``).
        with atomic_write_checked(path) as f:
            torch.save(staged, f)
        for older in self.directory.glob("snapshot-*"):  # with their digests
            if older not in (path, digest_path(path)):
                older.unlink(missing_ok=True)

    def _wait(self) -> None:
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def _off(self, why: str) -> None:
        _warn(
            f"no more snapshots in memory for this run ({why}): a retry resumes from the last checkpoint "
            "on disk (in a container, a larger --shm-size makes room)"
        )
        self.close()

    def close(self) -> None:
        """Wait for the write in flight (its failure is a warning), then end the writer."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            self._wait()
        except Exception as e:
            _warn(f"the last snapshot in memory could not be written: {e}")
        finally:
            pool.shutdown(wait=True)
            self._stager.close()

    def resume(self, newer_than: int | None = None) -> tuple[dict[str, Any], str] | None:
        """On a retry, the newest snapshot of any host of the job when its step is newer than
        ``newer_than`` (the step of the checkpoint on disk the caller would resume from; None: none),
        on every rank (loaded to the CPU), with where it came from in words (``the snapshot in
        HOST's memory``); None otherwise. Collective. A snapshot that cannot be read, or whose bytes
        differ from its digest's, is a warning (None: the disk's checkpoint is used)."""
        # Gathered even when not retried: each rank's view of that may differ (a node that joined a
        # restarted torchrun later counts no restart), and every rank must make the same collectives.
        offers = all_gather_object(Offer(socket.gethostname(), newest(self.directory), runtime.retried()))
        chosen = source(offers, newer_than) if any(o.retried for o in offers) else None
        if chosen is None:
            return None
        src, step = chosen
        loaded: dict[str, Any] | str | None = None
        if self.rank == src:
            try:
                path = self.directory / f"snapshot-{step:08d}.pt"
                check_digest(path)  # DigestError when its bytes changed since they were written
                found = torch.load(path, map_location="cpu", weights_only=True)
                loaded = found if isinstance(found, dict) else f"not a state (a {type(found).__name__})"
            except Exception as e:  # gone, torn, not a state: the disk's checkpoint instead
                loaded = f"{type(e).__name__}: {e}"
        loaded = broadcast_state(loaded, src)
        if not isinstance(loaded, dict):
            if self.rank == 0:
                _warn(f"the snapshot of step {step} in {offers[src].host}'s memory cannot be read: {loaded}")
            return None
        return loaded, f"the snapshot in {offers[src].host}'s memory"

    def __enter__(self) -> Snapshots:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, *_: object) -> None:
        self.close()
        ended = exc is None or (
            isinstance(exc, SystemExit) and exc.code in (None, runtime.EXIT_OK, runtime.EXIT_CHECKPOINTED)
        )
        if ended and self.writer:  # a failure keeps it: the next attempt resumes from it
            drop(self.directory)


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


def newest(directory: Path) -> int | None:
    """The step of the snapshot in ``directory`` (None when there is none, or it cannot be listed)."""
    try:
        steps = [int(m.group(1)) for p in directory.iterdir() if (m := _FILE.fullmatch(p.name))]
    except OSError:
        return None
    return max(steps, default=None)


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


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested dicts, lists and tuples (a checkpoint's state), depth first."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from tensors(v)


def tensor_bytes(value: Any) -> int:
    """Bytes held by the tensors in nested dicts, lists and tuples."""
    return sum(t.numel() * t.element_size() for t in tensors(value))


def storage_bytes(value: Any) -> int:
    """Bytes of the tensor storages in nested dicts, lists and tuples, each storage once: what
    torch.save writes (a storage shared by tensors, such as tied embedding and output weights, or
    viewed in part, is written once and whole)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors(value)}
    return sum(storages.values())


def _warn(message: str) -> None:
    print(f"gptlaunch: warning: {message}", file=sys.stderr, flush=True)
