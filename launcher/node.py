"""Node-side entry point: ``python -m launcher.node -- ARGV...``.

Fills in the ``{{placeholders}}`` of ``launcher.placeholders`` in ARGV and in the values of its
environment, then replaces itself with ARGV (exec: same pid, signals reach the real program). Only
Plans that hold placeholders use it; it imports nothing heavy, so it costs a few milliseconds.
"""

from __future__ import annotations

import os
import sys

from launcher.placeholders import PlaceholderError, names_in, substitute
from trainer.contract import EXIT_USAGE


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m launcher.node -- PROGRAM [ARGS...]", file=sys.stderr)
        return EXIT_USAGE
    try:
        env = {k: substitute(v) if names_in(v) else v for k, v in os.environ.items()}
        args = [substitute(a) for a in argv]
    except PlaceholderError as e:
        print(f"launcher.node: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        os.execvpe(args[0], args, env)
    except OSError as e:
        print(f"launcher.node: error: cannot run {args[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
