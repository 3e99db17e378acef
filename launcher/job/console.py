"""The launcher's own lines on the user's terminal: progress, warnings and summaries go to stderr,
so that stdout carries only what a script reads (a job id, a table, JSON)."""

from __future__ import annotations

import contextlib
import sys


def say(text: str) -> None:
    """Print ``text`` to stderr at once; a terminal that is gone (SIGHUP, a closed pipe) is ignored,
    since the job record keeps everything that matters."""
    with contextlib.suppress(OSError):
        print(text, file=sys.stderr, flush=True)
