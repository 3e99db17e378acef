"""``python -m gptlaunch.warm serve SOCKET [--until-stdin-closes]`` (the zygote; with the flag it
stops, as on SIGTERM, once its stdin ends: the SSH scheduler's, which lives as long as its ssh session)
or ``run SOCKET -- PROGRAM [ARGS...]`` (a client): see ``gptlaunch.warm``."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    usage = "usage: python -m gptlaunch.warm serve SOCKET [--until-stdin-closes] | run SOCKET -- PROGRAM ..."
    if len(argv) in (2, 3) and argv[0] == "serve" and argv[2:] in ([], ["--until-stdin-closes"]):
        from gptlaunch.warm.zygote import serve

        serve(argv[1], watch_stdin=len(argv) == 3)
    if len(argv) >= 4 and argv[0] == "run" and argv[2] == "--":
        from gptlaunch.warm.client import run

        run(argv[1], argv[3:])
    sys.exit(usage)


if __name__ == "__main__":
    main(sys.argv[1:])
