"""The kernel's OOM killer as a node sees it: counters the kernel keeps, never a log line to match.

When a host runs out of memory (its own, or the limit of the memory cgroup the node runs in: a SLURM
job's, a container's), the kernel's OOM killer ends the largest process with SIGKILL: to torchrun, a
rank killed by a signal like any other. ``MemoryWatch`` tells the two apart. At the node's start it
reads the kernel's count of OOM kills, for the node's memory cgroup (cgroup v1:
``memory.oom_control``'s ``oom_kill``; v2: ``memory.events``' ``oom_kill``; kernel 4.13 and later)
and for the whole host (``/proc/vmstat``'s ``oom_kill``); while the node runs it samples its ranks'
resident memory (RSS) four times a second; at the end a count that rose is an ``OomKilled`` report: how many
kills, in which scope, the limit, and each rank's last RSS seen. The verdict
(``launcher.job.failures.first_failure``) names a rank killed by SIGKILL on that node as out of memory.

A count on the host may be another process's (the host's scope holds every process on it): the
report says which scope rose, and the cgroup's count, where there is one, is the node's own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import psutil

POLL_S = 0.25  # between samples of the ranks' RSS (psutil: microseconds a process)
_PROC = Path("/proc")
_UNLIMITED = 1 << 62  # cgroup v1's "no limit" is a page-rounded 2**63 - 1


def _read_int(path: Path, key: str) -> int | None:
    """The value of ``key`` in a ``key value`` file (``memory.events``, ``/proc/vmstat``), None when the
    file or the key is missing."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class MemoryCgroup:
    """This process's memory cgroup: the file with its OOM kill count and its limit (bytes; None:
    unlimited or unknown)."""

    events: Path
    limit_file: Path

    @classmethod
    def of_self(cls, proc: Path = _PROC) -> MemoryCgroup | None:
        """This process's memory cgroup, v1 or v2 (from ``/proc/self/cgroup`` and where the hierarchy is
        mounted in ``/proc/self/mountinfo``); None where there is none to read."""
        try:
            groups = (proc / "self" / "cgroup").read_text().splitlines()
            mounts = (proc / "self" / "mountinfo").read_text().splitlines()
        except OSError:
            return None
        for line in groups:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(",") and path != "/":  # v1, below its root
                root = _mount_point(mounts, "cgroup", "memory")
                if root is not None:
                    where = root / path.lstrip("/")
                    return cls(where / "memory.oom_control", where / "memory.limit_in_bytes")
        for line in groups:
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2: one hierarchy
                root = _mount_point(mounts, "cgroup2", None)
                if root is not None and (root / path.lstrip("/") / "memory.events").exists():
                    where = root / path.lstrip("/")
                    return cls(where / "memory.events", where / "memory.max")
        return None

    def kills(self) -> int | None:
        return _read_int(self.events, "oom_kill")

    def limit(self) -> int | None:
        try:
            text = self.limit_file.read_text().strip()
        except OSError:
            return None
        if not text.isdigit() or int(text) >= _UNLIMITED:  # v2's "max", v1's huge number
            return None
        return int(text)


def _mount_point(mounts: list[str], fstype: str, option: str | None) -> Path | None:
    """Where a cgroup hierarchy of ``fstype`` (with the super option ``option``: v1's controller) is
    mounted, from mountinfo's lines (``... MOUNT_POINT ... - FSTYPE SOURCE SUPER_OPTIONS``)."""
    for line in mounts:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] != fstype:
            continue
        if option is None or option in tail[2].split(","):
            return Path(fields[4])
    return None


@dataclass
class MemoryWatch:
    """The OOM kill counts at the node's start, and its ranks' RSS while it runs (``start``, ``stop``).
    ``rss``: local rank -> the last RSS seen (bytes)."""

    cgroup: MemoryCgroup | None = field(default_factory=MemoryCgroup.of_self)
    rss: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._cgroup_kills = self.cgroup.kills() if self.cgroup is not None else None
        self._host_kills = _read_int(_PROC / "vmstat", "oom_kill")
        self._ranks: dict[int, int | None] = {}  # pid -> its LOCAL_RANK (None: not a rank)
        self._done = threading.Event()
        self._sampler: threading.Thread | None = None

    def start(self, root_pid: int) -> None:
        """Sample the RSS of the ranks below ``root_pid`` (the node's command) until ``stop``."""
        self._sampler = threading.Thread(target=self._sample, args=(root_pid,), daemon=True)
        self._sampler.start()

    def stop(self) -> None:
        """Stop sampling; ``rss`` holds still from here on."""
        self._done.set()
        if self._sampler is not None:
            self._sampler.join()

    def _sample(self, root_pid: int) -> None:
        while not self._done.wait(POLL_S):
            try:
                tree = psutil.Process(root_pid).children(recursive=True)
            except psutil.Error:
                return
            for process in tree:
                try:
                    if process.pid not in self._ranks:
                        self._ranks[process.pid] = _local_rank(process)
                    local_rank, rss = self._ranks[process.pid], process.memory_info().rss
                    if local_rank is not None and rss > 0:  # a killed one's zombie holds none
                        self.rss[local_rank] = rss
                except psutil.Error:  # it ended meanwhile: its last sample stands
                    continue

    def killed(self) -> tuple[Literal["cgroup", "host"], int, int] | None:
        """Since the start: (scope, kills, limit in bytes) when the OOM killer ended a process in the
        node's memory cgroup ("cgroup": its limit), or, where the node has no cgroup count to read, on
        the host ("host": its memory); None when it did not, or no count can be read. A host's count
        that rose while the node's cgroup's did not is another process's kill: the kernel counts a
        host-wide OOM kill in its victim's cgroup too."""
        if self.cgroup is not None and self._cgroup_kills is not None:
            now = self.cgroup.kills()
            if now is None or now == self._cgroup_kills:
                return None
            limit = self.cgroup.limit()
            return ("cgroup", now - self._cgroup_kills, limit or psutil.virtual_memory().total)
        host = _read_int(_PROC / "vmstat", "oom_kill")
        if host is not None and self._host_kills is not None and host > self._host_kills:
            return ("host", host - self._host_kills, psutil.virtual_memory().total)
        return None


def _local_rank(process: psutil.Process) -> int | None:
    """A rank's LOCAL_RANK (torchrun sets it in each worker's environment), else None: also for the
    processes a rank starts (DataLoader and compile workers inherit its environment)."""
    value = _rank_env(process)
    parent = process.parent()
    return int(value) if value is not None and (parent is None or _rank_env(parent) is None) else None


def _rank_env(process: psutil.Process) -> str | None:
    env = process.environ()
    value = env.get("LOCAL_RANK", "")
    return value if value.isdigit() and "TORCHELASTIC_RUN_ID" in env else None
