"""The launcher's own lines on the user's terminal: progress, warnings and summaries go to stderr,
so that stdout carries only what a script reads (a job id, a table, JSON)."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable
from typing import Literal

Tee = Literal["auto", "all", "rank0"]
TEE_ALL_MAX_NODES = 4  # --tee auto shows every node's lines up to this many nodes, rank 0's beyond
# A line worth showing from any node: Python's and torch's warnings and errors, glog's W/E/F lines
# (torchrun, NCCL's C++), tracebacks, signals, and the launcher's own host agents' failures.
NOTEWORTHY = re.compile(
    r"warn|error|exception|traceback|fail|fatal|killed|signal|timed? ?out|cannot|lost|\bnan\b"
    r"|(?:^|\s)[WEF]\d{4} ",
    re.IGNORECASE,
)

# Lines that say nothing to act on: torch's start-up line of the flight recorder's debug server,
# c10d's warning when a peer's address has no name (as in network namespaces), and torchelastic's
# note, on a failure, that its agent has no error file of its own to copy the worker's into. Never on
# the console; the node logs keep them.
NOISE = re.compile(
    r"WorkerServer\.cpp:\d+\] \[c10d\] Server listening|hostname of the client socket cannot be retrieved"
    r"|no error file defined for parent, to copy child error file"
)


def say(text: str) -> None:
    """Print ``text`` to stderr at once; a terminal that is gone (SIGHUP, a closed pipe) is ignored,
    since the job record keeps everything that matters."""
    with contextlib.suppress(OSError):
        print(text, file=sys.stderr, flush=True)


def shows_all(tee: Tee, nnodes: int) -> bool:
    """Whether ``--tee`` shows every line of a job of ``nnodes`` nodes."""
    return tee == "all" or (tee == "auto" and nnodes <= TEE_ALL_MAX_NODES)


def console_lines(tee: Tee, nnodes: int) -> Callable[[str], bool]:
    """Which followed lines (``nodeK | text``, from ``launcher.job.logs.tail``) the console shows:
    ``all`` every line; ``rank0`` node 0's own lines and its rank 0's, and from every node the lines
    NOTEWORTHY matches; ``auto`` is ``all`` up to TEE_ALL_MAX_NODES nodes, else ``rank0``. Never the
    NOISE lines."""
    every = shows_all(tee, nnodes)

    def keep(line: str) -> bool:
        label, _, text = line.partition(" | ")
        if NOISE.search(text):
            return False
        rank0 = text.startswith("[rank0]:") or not text.startswith("[rank")
        if every or (label.endswith("node0") and rank0):
            return True
        return NOTEWORTHY.search(text) is not None

    return keep
