"""``python -m gptlaunch.warm serve SOCKET`` (the zygote) or ``run SOCKET -- PROGRAM [ARGS...]`` (a
client): see ``gptlaunch.warm``."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    usage = "usage: python -m gptlaunch.warm serve SOCKET | run SOCKET -- PROGRAM [ARGS...]"
    if len(argv) == 2 and argv[0] == "serve":
        from gptlaunch.warm.zygote import serve

        serve(argv[1])
    if len(argv) >= 4 and argv[0] == "run" and argv[2] == "--":
        from gptlaunch.warm.client import run

        run(argv[1], argv[3:])
    sys.exit(usage)


if __name__ == "__main__":
    main(sys.argv[1:])
