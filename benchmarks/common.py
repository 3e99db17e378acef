"""What the benchmarks share: input text, the flags about runs and outside load, and directories on
the SSH dev hosts' own disks."""

from __future__ import annotations

import argparse
import shutil
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


def own_disk(state: Path, name: str) -> Path:
    """``STATE/local/NAME``, made here: a directory that this machine and each SSH dev host
    (``deploy/ssh/dev-hosts.sh``, its state dir ``state``) see on a disk of its own. Remove it from
    all of them with ``forget_own_disk``."""
    path = state / "local" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def forget_own_disk(state: Path, path: Path) -> None:
    """Remove ``path`` (an ``own_disk``) from this machine's disk and every dev host's."""
    for root in [state / "local", *(state / "hosts").glob("*/local")]:
        shutil.rmtree(root / path.relative_to(state / "local"), ignore_errors=True)
