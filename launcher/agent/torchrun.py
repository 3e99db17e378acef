"""``python -m launcher.agent.torchrun ARGS``: torchrun (``python -m torch.distributed.run ARGS``), less
the last garbage collection of its interpreter's exit.

An interpreter that has imported torch spends about 0.3 s of its exit (2-core CPU, torch 2.13) in the
collection that CPython runs at shutdown over every object left, torch's modules included. A
torchrun's exit is on the path of every failure: the launcher knows an attempt failed once its nodes'
torchruns have ended, and the next attempt starts after that. ``gc.freeze()`` as the last exit
handler moves every object out of the collector's reach first; everything else of the exit (the
non-daemon threads waited for, the other exit handlers, the streams flushed) is as ``python -m``'s.
Measured on a local 2-node job, a rank SIGKILLed: kill → attempt ended, median 1.6 s → 1.2 s.

The node agent runs this in place of ``-m torch.distributed.run`` (``fast_exit``) only where
torchrun's interpreter is the agent's own, which has this module (the agent is part of it): on SSH
hosts and SLURM nodes, and inside a compose container, whose agent runs in the image. Elsewhere (a
local job's ``--python`` other than the launcher's, a torchrun in a container the agent starts)
torchrun runs as rendered.
"""

from __future__ import annotations

import atexit
import gc
import runpy
import shutil
import sys

TORCHRUN = ["-m", "torch.distributed.run"]
NODE_ENTRY = ["-m", "launcher.job.node"]  # fills in a node's placeholders, then execs its command


def fast_exit(argv: list[str], path: str | None = None) -> list[str]:
    """``argv`` with this module in place of torchrun's, where ``argv`` is ``PYTHON -m
    torch.distributed.run ARGS`` (or that behind ``PYTHON -m launcher.job.node ... --``) and
    ``PYTHON``, looked up in ``path`` (the ``PATH`` it will run with; None: this process's), is this
    process's own interpreter (the same path, not the same file: a venv's python is a link to one
    shared by every venv); else ``argv`` unchanged."""
    if argv[1:3] == NODE_ENTRY and "--" in argv:  # behind ``launcher.job.node``: its command
        cut = argv.index("--") + 1
        return [*argv[:cut], *fast_exit(argv[cut:], path)]
    if argv[1:3] != TORCHRUN or (shutil.which(argv[0], path=path) or argv[0]) != sys.executable:
        return argv
    return [argv[0], "-m", "launcher.agent.torchrun", *argv[3:]]


def main() -> None:
    """torchrun with ``sys.argv``; an exception it raises ends this process as it ends ``python -m``."""
    atexit.register(gc.freeze)  # the first handler registered is the last run: after torch's own
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
