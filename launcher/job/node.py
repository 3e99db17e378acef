"""Node-side entry point: ``python -m launcher.job.node [--workdir DIR] [--fill-env NAME]... -- ARGV``.

Changes to the job's working directory (``--workdir``: a node that lacks it fails with a message
naming the host, where SLURM's srun would silently start the task in /tmp), fills in the
``{{placeholders}}`` of ``launcher.job.placeholders`` in ARGV and in the environment variables named by
``--fill-env`` (only those: an unrelated variable may hold braces), then replaces itself with ARGV
(exec: same pid, signals reach the real program). SLURM's nodes and Plans that hold placeholders use
it; it imports no torch and no pydantic.
"""

from __future__ import annotations

import os
import socket
import sys

from gptlaunch.contract import EXIT_USAGE
from launcher.job.placeholders import PlaceholderError, substitute

USAGE = "usage: python -m launcher.job.node [--workdir DIR] [--fill-env NAME]... -- PROGRAM [ARGS...]"


def main(argv: list[str]) -> int:
    fill: list[str] = []
    workdir: str | None = None
    while argv[:1] in (["--fill-env"], ["--workdir"]) and len(argv) > 1:
        if argv[0] == "--workdir":
            workdir = argv[1]
        else:
            fill.append(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(USAGE, file=sys.stderr)
        return EXIT_USAGE
    if workdir is not None:
        try:
            os.chdir(workdir)
        except OSError as e:
            print(
                f"launcher.job.node: error: workdir (--workdir) {workdir} on host {socket.gethostname()}: "
                f"{e.strerror}; every node needs it (a shared filesystem): create it there or pass "
                "another --workdir",
                file=sys.stderr,
            )
            return EXIT_USAGE
    try:
        env = dict(os.environ)
        for name in fill:
            env[name] = substitute(env.get(name, ""))
        args = [substitute(a) for a in argv]
    except PlaceholderError as e:
        print(f"launcher.job.node: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        os.execvpe(args[0], args, env)
    except OSError as e:
        print(f"launcher.job.node: error: cannot run {args[0]!r}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
