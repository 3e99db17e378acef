"""Node-side entry point: ``python -m launcher.job.node [--fill-env NAME]... -- ARGV...``.

Fills in the ``{{placeholders}}`` of ``launcher.job.placeholders`` in ARGV and in the environment
variables named by ``--fill-env`` (only those: an unrelated variable may hold braces), then replaces
itself with ARGV (exec: same pid, signals reach the real program). Only Plans that hold placeholders
use it; it imports no torch and no pydantic.
"""

from __future__ import annotations

import os
import sys

from launcher.job.placeholders import PlaceholderError, substitute
from trainer.contract import EXIT_USAGE


def main(argv: list[str]) -> int:
    fill: list[str] = []
    while argv[:1] == ["--fill-env"] and len(argv) > 1:
        fill.append(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m launcher.job.node [--fill-env NAME]... -- PROGRAM [ARGS...]", file=sys.stderr)
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
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
