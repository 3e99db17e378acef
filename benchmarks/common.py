"""What the benchmarks' command lines share: input text and the flags about runs and outside load."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from procs import REPO_ROOT

DEFAULT_TEXT = REPO_ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"


def add_run_flags(p: argparse.ArgumentParser, *, timeout_s: float, quiet_wait_s: float) -> None:
    """``--text-files``, ``--timeout`` (seconds per run), ``--quiet-wait`` and ``--quiet-load``."""
    p.add_argument("--text-files", nargs="+", help=f"input text (default: {DEFAULT_TEXT})")
    p.add_argument(
        "--timeout", type=float, default=timeout_s, help=f"seconds per run (default: {timeout_s:g})"
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=quiet_wait_s,
        help="before each run, wait up to this many seconds for other processes to use at most "
        f"--quiet-load of the CPUs; 0 disables (default: {quiet_wait_s:g})",
    )
    p.add_argument(
        "--quiet-load", type=float, default=0.2, help="see --quiet-wait, fraction of all CPUs (default: 0.2)"
    )


def text_files(given: Sequence[str] | None, parser: argparse.ArgumentParser) -> tuple[Path, ...]:
    """``--text-files`` when given, else WikiText-2 valid.txt next to the repository (../shared, never
    copied into it); exits 2 through ``parser`` when a file does not exist."""
    paths = tuple(Path(p).resolve() for p in given) if given else (DEFAULT_TEXT,)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        parser.error(
            f"input text not found: {', '.join(missing)} (the shared WikiText-2 files live in "
            "../shared/data/wikitext-2/ next to the repository; pass --text-files FILE...)"
        )
    return paths
