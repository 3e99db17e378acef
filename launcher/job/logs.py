"""Reading per-node log files as one stream of ``node<k> | line`` lines: the terminal view of a job,
``launcher logs`` and ``launcher logs --follow``; following a job from its record until it ends."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from launcher.job.record import JobRecord, JobStatus

POLL_S = 0.1  # how often followed files are read again when nothing new came
TICK = ""  # what a follower yields when nothing new came (launcher.job.collapse holds lines back)
END_BYTES = 8 << 20  # what end-of-job readers look at: a days-long run's node log can be gigabytes


def log_end(path: Path, max_bytes: int = END_BYTES) -> str:
    """The last ``max_bytes`` bytes of ``path`` as text (where torchrun's failure summary and a hang
    report are: the end of a node log), "" when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tail(
    files: list[tuple[str, Path]],
    keep_going: Callable[[], bool] = lambda: False,
    relabel: Callable[[], dict[Path, str]] | None = None,
) -> Iterator[str]:
    """Yield every line of each ``(label, file)`` as ``label | line`` (with its newline), then, while
    ``keep_going()`` is true, the lines added later. Files that do not exist yet are read once they
    appear. After ``keep_going()`` turns false, what was written meanwhile is still yielded, and a
    last line without its newline too. While following, TICK (an empty string) is yielded every
    POLL_S seconds that bring nothing new. ``relabel``: the labels now, asked (once a pass) when a
    file is opened (a retried job's next attempt may run a node on another host)."""
    labels = {path: label for label, path in files}
    handles: dict[Path, TextIO] = {}
    partial: dict[Path, str] = {}
    try:
        while True:
            going = keep_going()  # asked before reading: nothing written before it turned false is lost
            moved = False
            fresh: dict[Path, str] | None = None  # the labels now, asked at most once a pass
            for path in list(labels):
                opened = path not in handles
                lines = _new_lines(path, handles, partial)
                if opened and path in handles and relabel is not None:  # a node's (next) log
                    fresh = relabel() if fresh is None else fresh
                    labels[path] = fresh.get(path, labels[path])
                for line in lines:
                    moved = True
                    yield f"{labels[path]} | {line}\n"
            if not going:
                break
            if not moved:
                time.sleep(POLL_S)
                yield TICK  # nothing new: a consumer that holds lines back may show them now
        for path, label in labels.items():
            if partial.get(path):
                yield f"{label} | {partial[path]}\n"
    finally:
        for handle in handles.values():
            handle.close()


def node_logs(
    state: Callable[[JobRecord], JobStatus], record: JobRecord, node: int | None, follow: bool
) -> Iterator[str]:
    """A scheduler's ``logs`` when its nodes write ``node-<k>.log`` in the job record: the lines
    as ``<label> | line`` (``NodePlan.label``, of the plan when each log was opened: a replaced host's
    spare is named), with ``follow`` until ``state`` (the scheduler's) is terminal."""
    nodes = [n for n in record.plan().nodes if node is None or n.node_rank == node]
    files = [(n.label, record.node_log(n.node_rank)) for n in nodes]

    def relabel() -> dict[Path, str]:  # after a host was replaced, the plan names the spare
        return {record.node_log(n.node_rank): n.label for n in record.plan().nodes}

    return tail(files, lambda: follow and not state(record).state.is_terminal, relabel)


def wait_terminal(
    state: Callable[[JobRecord], JobStatus], record: JobRecord, timeout_s: float, poll_s: float
) -> JobStatus | None:
    """The job's status (``state``, the scheduler's) once it is terminal, or None if it is not within
    ``timeout_s`` seconds (asked every ``poll_s`` seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = state(record)
        if status.state.is_terminal:
            return status
        time.sleep(poll_s)
    return None


def _replaced(path: Path, handle: TextIO) -> bool:
    """Whether ``path`` no longer names the file ``handle`` reads (moved away, or another in its place)."""
    try:
        return os.stat(path).st_ino != os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return True


def _new_lines(path: Path, handles: dict[Path, TextIO], partial: dict[Path, str]) -> list[str]:
    handle = handles.get(path)
    if handle is None:
        if not path.exists():
            return []
        handle = handles[path] = open(path, errors="replace")  # noqa: SIM115
    chunk = handle.read()
    if not chunk:
        if _replaced(path, handle):  # archived (a retried job's attempt): follow the new file next
            handle.close()
            del handles[path]
            return [partial.pop(path)] if partial.get(path) else []
        return []
    *lines, rest = (partial.pop(path, "") + chunk).split("\n")
    if rest:
        partial[path] = rest
    return lines
