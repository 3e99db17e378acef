"""How a training process ends: its exit code from a ``SystemExit``, and an exit that skips the
interpreter's finalization (used by ``gptlaunch.shim`` and the built-in trainer)."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` after the atexit handlers and a flush, without the interpreter's finalization:
    there, gloo's worker threads (torch 2.13) may still hold work whose destruction aborts the process
    (SIGABRT, "terminate called without an active exception"; pytorch/pytorch PR 179291), which
    torchrun then reports as the failure of a rank that had finished, or hides its real error."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_code(e: SystemExit) -> int:
    """The process exit code of ``e``, as the interpreter makes it (a message is printed, exit 1)."""
    if isinstance(e.code, str):
        print(e.code, file=sys.stderr)
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
