"""The typed channel from the nodes: every message a node sends the launcher is a ``NodeReport``, and
this module is the only one that writes or reads them (an import-linter contract says so).

A report is data, never a line to find in a log: logs are for people. Its kind is one of the classes
below (``NodeReport``, told apart by ``kind``); ``status``, ``probe`` and ``pulled`` answer an SSH host
agent's short command (``launcher.agent status|probe|pull``) on that command's channel, never stored.

Where they travel: each node appends its reports, one JSON object a line, to
``<job dir>/reports/node-<k>.jsonl`` with one ``write`` of an ``O_APPEND`` file (one writer a node: no
two reports are ever glued). A node that sees the job record (local, SLURM, compose) appends there
itself; an SSH host, which may share no file system with the launcher, sends each report as a frame
on its agent's own channel (``launcher.job.channel``), and the launcher's end appends it there. The
readers filter by time: a requeued or retried job's earlier attempts' reports stay, older.

A process the node runs (a collective preflight worker, later a user's script) reports the same way,
into the directory its environment names (``REPORT_DIR_ENV``): one file per process, which the node
agent forwards on its channel once the process ended (SSH), or which is the job record's own.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from gptlaunch.contract import Beat
from launcher.job.hang import HangReport
from launcher.job.measurements import CollectiveError, CollectiveResult, Probe

REPORTS_DIR = "reports"
REPORT_DIR_ENV = "GPTLAUNCH_REPORT_DIR"  # where a node's processes put their reports


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    node: int  # the node rank that sent it (the judging node for a check's refusal)
    time: float = Field(default_factory=time.time)  # epoch seconds


class Refused(_Report):
    """A check before training ended the job: exit 3 (a parity mismatch, nodes the health gate named,
    a newest checkpoint out of reach), 1 (a node gave no probe) or 2 (the gate could not run)."""

    kind: Literal["refused"] = "refused"
    check: Literal["parity", "health", "checkpoint"]
    exit_code: int
    message: str
    nodes: list[int] = []  # the node ranks the health gate named


class Hang(_Report):
    """The node's watchdog found its ranks stalled; ``hang`` holds every rank's state and stack."""

    kind: Literal["hang"] = "hang"
    hang: HangReport


class CollectiveDone(_Report):
    """Rank 0 of the collective preflight: what it measured across every rank."""

    kind: Literal["collective"] = "collective"
    rank: int
    result: CollectiveResult


class CollectiveFailed(_Report):
    """A rank of the collective preflight that failed, and why."""

    kind: Literal["collective-failed"] = "collective-failed"
    rank: int
    error: CollectiveError


class NodeStatus(_Report):
    """Whether the node runs, its exit code once it ended (None before, or when it left none), and
    its ranks' latest heartbeats."""

    kind: Literal["status"] = "status"
    running: bool
    exit_code: int | None
    beats: list[Beat] = []


class Probed(_Report):
    """The host's versions, GPUs and network (``launcher.preflight.probe``), for version parity and
    the job's plan."""

    kind: Literal["probe"] = "probe"
    probe: Probe


class Pulled(_Report):
    """The host pulled the job's image with ``runtime`` (docker or podman) in ``seconds``."""

    kind: Literal["pulled"] = "pulled"
    runtime: str
    seconds: float


class Saved(_Report):
    """A file of the node's checkpoint dir ``directory`` (absolute, the same path here) appeared, was
    renamed into place or was rewritten, and then stayed unchanged for one poll: a checkpoint, on a host
    that shares no file system with the launcher, or in a SLURM node's own run dir. ``files``: every
    file there, name -> bytes; ``changed``: those that made it a save, name -> mtime (ns since the
    epoch, the host's clock)."""

    kind: Literal["saved"] = "saved"
    host: str
    directory: str
    files: dict[str, int]
    changed: dict[str, int] = {}


class OomKilled(_Report):
    """The kernel's OOM killer ended processes of the node while it ran (``launcher.agent.memory``):
    ``kills`` of them, in the node's memory cgroup ("cgroup") or elsewhere on its host ("host");
    ``limit_bytes``: that cgroup's limit, or the host's memory; ``rss``: each local rank's last
    resident memory seen (bytes)."""

    kind: Literal["oom"] = "oom"
    host: str
    scope: Literal["cgroup", "host"]
    kills: int
    limit_bytes: int
    rss: dict[int, int] = {}


class RankFailed(_Report):
    """A rank of the node failed: its ``local_rank`` ended with ``exit_code`` (negative: killed by
    signal -N), as the node's torchrun found it (``launcher.agent.torchrun``), before it stops the node's
    other ranks: the launcher marks the attempt failing at once."""

    kind: Literal["rank-failed"] = "rank-failed"
    local_rank: int
    exit_code: int


class FileBack(_Report):
    """A small file a node wrote for the launcher (a torchelastic error file, the stop marker), sent
    back from a host that shares no file system with it: written here at ``path`` (absolute, inside
    the job record or its run dir), never appended to the reports."""

    kind: Literal["file"] = "file"
    path: str
    text: str


NodeReport = Annotated[
    Refused
    | Hang
    | CollectiveDone
    | CollectiveFailed
    | NodeStatus
    | Probed
    | Pulled
    | Saved
    | OomKilled
    | RankFailed
    | FileBack,
    Field(discriminator="kind"),
]
_ADAPTER: TypeAdapter[NodeReport] = TypeAdapter(NodeReport)
ReportT = TypeVar("ReportT", bound=_Report)


def encode(report: NodeReport) -> bytes:
    """One report as one line of JSON."""
    return report.model_dump_json().encode() + b"\n"


def decode(data: bytes) -> NodeReport:
    """A report from ``encode``'s bytes. Raises ValueError (pydantic's ValidationError) when it is not
    one this version knows."""
    return _ADAPTER.validate_json(data)


def append(job_dir: Path, report: NodeReport) -> None:
    """Append ``report`` to its node's file in the job record: one ``write`` of one line."""
    append_to(job_dir / REPORTS_DIR, f"node-{report.node}", report)


def append_to(directory: Path, name: str, report: NodeReport) -> None:
    """Append ``report`` to ``directory/name.jsonl`` (one writer a file): one ``write`` of one line."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / f"{name}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, encode(report))
    finally:
        os.close(fd)


def read(job_dir: Path, kind: type[ReportT], since: float = 0.0) -> list[ReportT]:
    """Every report of ``kind`` in the job record sent at or after ``since`` (epoch seconds), oldest
    first."""
    return read_dir(job_dir / REPORTS_DIR, kind, since)


def read_dir(directory: Path, kind: type[ReportT], since: float = 0.0) -> list[ReportT]:
    """``read`` of the reports in ``directory``."""
    return [r for r in read_all(directory) if isinstance(r, kind) and r.time >= since]


def read_all(directory: Path) -> list[NodeReport]:
    """Every report in ``directory``'s ``*.jsonl`` files, oldest first. A line that is not a whole
    report of this version (a process killed in mid-write, another version's kind) is skipped: it
    cannot be acted on."""
    return _read_on(directory, None)


class Tail:
    """The reports appended to a job record from its making on: each ``new()`` reads each node's file
    on from where the last read ended (a watcher that polls often reads each report once)."""

    def __init__(self, job_dir: Path) -> None:
        self.directory = job_dir / REPORTS_DIR
        self.offsets: dict[Path, int] = {}
        for path in self.directory.glob("*.jsonl"):
            with contextlib.suppress(OSError):
                self.offsets[path] = path.stat().st_size

    def new(self) -> list[NodeReport]:
        """The whole reports appended since the last call (a line still being written waits), oldest
        first."""
        return _read_on(self.directory, self.offsets)


def _read_on(directory: Path, offsets: dict[Path, int] | None) -> list[NodeReport]:
    """The reports of ``directory``'s ``*.jsonl`` files, oldest first, less the lines that are not one:
    every line (``offsets`` None), or the whole lines from ``offsets`` on (a file not in it: from its
    start), and ``offsets`` moves past them."""
    found: list[NodeReport] = []
    for path in sorted(directory.glob("*.jsonl")):
        start = offsets.get(path, 0) if offsets is not None else 0
        try:
            if path.stat().st_size <= start:  # nothing new: not opened (a shared file system)
                continue
            with path.open("rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            continue
        if offsets is not None:  # a line still being written waits for the next call
            data = data[: data.rfind(b"\n") + 1]
            offsets[path] = start + len(data)
        for line in data.splitlines():
            with contextlib.suppress(ValueError):
                found.append(decode(line))
    return sorted(found, key=lambda r: r.time)


def hangs(job_dir: Path, since: float = 0.0) -> list[HangReport]:
    """The newest hang report of each node sent at or after ``since`` (epoch seconds), by node rank."""
    newest = {r.node: r.hang for r in read(job_dir, Hang, since)}  # ``read`` is oldest first
    return [newest[node] for node in sorted(newest)]
