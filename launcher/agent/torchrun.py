"""``python -m launcher.agent.torchrun ARGS``: torchrun (``python -m torch.distributed.run ARGS``), less
the last garbage collection of its interpreter's exit, and telling its node agent of a failed rank.

An interpreter that has imported torch spends about 0.3 s of its exit (2-core CPU, torch 2.13) in the
collection that CPython runs at shutdown over every object left, torch's modules included. A
torchrun's exit is on the path of every failure: the launcher knows an attempt failed once its nodes'
torchruns have ended, and the next attempt starts after that. ``gc.freeze()`` as the last exit
handler moves every object out of the collector's reach first; everything else of the exit (the
non-daemon threads waited for, the other exit handlers, the streams flushed) is as ``python -m``'s.
Measured on a local 2-node job, a rank SIGKILLed: kill → attempt ended, median 1.6 s → 1.2 s.

It tells the node agent of the first failed rank the moment torchrun finds it, before it stops the
node's other ranks and exits: one JSON line, ``{"local_rank": N, "exit_code": N (negative: killed by
signal -N)}``, on the pipe that ``FAILED_FD_ENV`` names. The launcher then knows the attempt fails
0.15 s after a kill, not 0.5-0.7 s (``benchmarks/bench_failing.py``; more on a loaded machine), and
the console holds the survivors' lines (``launcher.job.survivors``) for that much less. Not with
torchrun's in-place restarts (``--max-restarts`` above 0), where a failed rank ends no node.

The node agent runs this in place of ``-m torch.distributed.run`` (``fast_exit``) only where
torchrun's interpreter is the agent's own, which has this module (the agent is part of it): on SSH
hosts and SLURM nodes, and inside a compose container, whose agent runs in the image. Elsewhere (a
local job's ``--python`` other than the launcher's, a torchrun in a container the agent starts)
torchrun runs as rendered.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import runpy
import shutil
import sys

TORCHRUN = ["-m", "torch.distributed.run"]
NODE_ENTRY = ["-m", "launcher.job.node"]  # fills in a node's placeholders, then execs its command
FAILED_FD_ENV = "GPTLAUNCH_FAILED_FD"  # the pipe to the node agent for the first failed rank


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


def tell_failures(fd: int) -> None:
    """Write the first failed rank that torchrun finds (``SubprocessContext._capture_process_failures``,
    torch 2.13: before it stops the node's other ranks) to ``fd`` as one JSON line, then close it.
    Where torch has no such method nothing is told: the launcher learns of the failure when torchrun
    exits, as before."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    capture = getattr(SubprocessContext, "_capture_process_failures", None)
    if capture is None:
        os.close(fd)
        return
    out = os.fdopen(fd, "w")

    def captured(context: SubprocessContext, done: set[int]) -> None:
        capture(context, done)
        if out.closed:
            return
        with contextlib.suppress(Exception):  # torch's own structures differ, or the agent is gone
            local_rank, failure = next(iter(context._failures.items()), (None, None))
            if failure is None:
                return
            out.write(json.dumps({"local_rank": local_rank, "exit_code": failure.exitcode}) + "\n")
            out.flush()
        with contextlib.suppress(OSError):
            out.close()

    SubprocessContext._capture_process_failures = captured  # type: ignore[method-assign,assignment]


def restarts_in_place(argv: list[str]) -> bool:
    """Whether torchrun's ``argv`` (its flags as ``launcher.job.torchrun`` renders them: ``--flag=value``,
    then the program) asks it to restart failed ranks in place (``--max-restarts`` above 0): a rank's
    failure then ends no node, and nothing is told."""
    for arg in argv:
        if not arg.startswith("-"):  # the program: its arguments are its own
            return False
        name, _, value = arg.partition("=")
        if name in ("--max-restarts", "--max_restarts"):
            return value.isdigit() and int(value) > 0
    return False


def main() -> None:
    """torchrun with ``sys.argv``; an exception it raises ends this process as it ends ``python -m``."""
    atexit.register(gc.freeze)  # the first handler registered is the last run: after torch's own
    fd = os.environ.pop(FAILED_FD_ENV, None)  # not for the ranks
    if fd is not None:
        if restarts_in_place(sys.argv[1:]):
            os.close(int(fd))  # EOF: the agent tells nothing
        else:
            tell_failures(int(fd))
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
