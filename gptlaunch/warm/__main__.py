"""``python -m gptlaunch.warm serve SOCKET [--lease-s S]`` (the zygote; with a lease it stops, as on
SIGTERM, once its stdin ends or brings nothing for S seconds: the SSH scheduler's, which the
supervisor keeps alive over its ssh session) or ``run SOCKET -- PROGRAM [ARGS...]`` (a client): see
``gptlaunch.warm``."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    usage = "usage: python -m gptlaunch.warm serve SOCKET [--lease-s S] | run SOCKET -- PROGRAM [ARGS...]"
    if argv[:1] == ["serve"] and (len(argv) == 2 or (len(argv) == 4 and argv[2] == "--lease-s")):
        from gptlaunch.warm.zygote import serve

        if len(argv) == 2:
            serve(argv[1])
        lease_s = _seconds(argv[3])
        if lease_s is None:
            sys.exit(f"{usage}\n--lease-s takes seconds > 0, not {argv[3]!r}")
        serve(argv[1], lease_s=lease_s)
    if len(argv) >= 4 and argv[0] == "run" and argv[2] == "--":
        from gptlaunch.warm.client import run

        run(argv[1], argv[3:])
    sys.exit(usage)


def _seconds(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value > 0 else None


if __name__ == "__main__":
    main(sys.argv[1:])
