"""Secrets on stdin, both ends: the supervisor writes a job's secret variables as one JSON line to a node
client's stdin (``ssh host ...``, ``docker start --attach ...``); the node side (the SSH host agent, the
compose container's entry) reads that line once and gives the variables to torchrun's environment only.
They are never on a command line, in a file or in a log.
"""

from __future__ import annotations

import contextlib
import json
import select
import sys
from typing import IO


def send(stdin: IO[bytes], secrets: dict[str, str], *, keep_open: bool) -> None:
    """Write ``secrets`` to a client's ``stdin`` as one JSON line, then close it unless ``keep_open``.
    A client that already exited is not an error here: its exit code and log say why it failed."""
    with contextlib.suppress(OSError):
        stdin.write((json.dumps(secrets) + "\n").encode())
        stdin.flush()
        if not keep_open:
            stdin.close()


def receive(timeout_s: float | None = None) -> dict[str, str] | None:
    """The secrets line from this process's stdin: {} when stdin is empty, a terminal or not JSON;
    None when ``timeout_s`` seconds pass with nothing to read (a writer-less stdin: run by hand)."""
    if sys.stdin is None or sys.stdin.isatty():
        return {}
    if timeout_s is not None and not select.select([sys.stdin], [], [], timeout_s)[0]:
        return None
    line = sys.stdin.readline()
    try:
        data = json.loads(line) if line.strip() else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
