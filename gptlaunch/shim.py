"""``python -m gptlaunch.shim SCRIPT.py ARGS`` or ``python -m gptlaunch.shim -m MODULE ARGS``: run a
user's training program in this process, as ``python SCRIPT.py ARGS`` (``python -m MODULE ARGS``)
would, with the launcher's watch started first (``gptlaunch.runtime.watch``: the heartbeat after
every optimizer step, the flight recorder). The launcher renders every rank of a Python program this
way; the script needs no change and sees its own ``sys.argv``, ``__main__`` and exit code. From the
job's second attempt on, the program's ``--resume-args`` (``RESUME_ARGS_ENV``) follow its arguments.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from gptlaunch import runtime
from gptlaunch.contract import RESUME_ARGS_ENV
from gptlaunch.exits import exit_code, exit_now

USAGE = "usage: python -m gptlaunch.shim SCRIPT.py [ARGS...] | -m MODULE [ARGS...]"


def main(argv: list[str]) -> None:
    """Run the program that ``argv`` names (see the module docstring). Exits 2 with a usage line when
    it names none; the program's own exit (or exception) is this process's."""
    module = bool(argv) and argv[0] == "-m"
    target_at = 1 if module else 0
    if len(argv) <= target_at:
        sys.exit(f"{USAGE}\ngptlaunch.shim: no program given")
    target, args = argv[target_at], argv[target_at + 1 :]
    runtime.whole_lines()
    if runtime.resumed():
        args += json.loads(os.environ.get(RESUME_ARGS_ENV, "[]"))
    runtime.watch()
    sys.argv = [target, *args]  # for -m, runpy then puts the module's path in argv[0], as python does
    if not module:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT.py` sets it
    _recorded(lambda: _run(target, module))()


def _run(target: str, module: bool) -> None:
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def _recorded(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` under torchelastic's ``record``: an uncaught exception goes to the rank's error file,
    which the launcher's root cause reads, as the built-in trainer's does."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:
        return fn
    return record(fn)


def _entry() -> NoReturn:
    try:
        main(sys.argv[1:])
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:  # as Python would print it; the error file is written already (record)
        traceback.print_exc()
        code = 1
    exit_now(code)


if __name__ == "__main__":
    _entry()
