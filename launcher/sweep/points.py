"""A sweep's points and each run's arguments: ``--sweep KEY=V1,V2`` (repeated: their grid) or
``--sweep-file FILE`` (YAML: a list of mappings, one per run), checked before anything is submitted
(where the values go: ``docs/sweeps.md``)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from pathlib import Path

import yaml

MAX_POINTS = 1000  # more runs than this from one command need --yes: a typo in a grid multiplies
# ``{key}`` in a program's argument, not ``{{name}}`` (the Plan's late-bound placeholders)
PLACEHOLDER = re.compile(r"(?<!\{)\{([A-Za-z_][A-Za-z0-9_]*)\}(?!\})")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")

Point = dict[str, str]  # key -> value, as typed


class SweepError(ValueError):
    """A sweep that cannot run; the message names the flag, the value and the fix (exit 2)."""


def grid(specs: Sequence[str]) -> list[Point]:
    """The points of ``--sweep KEY=V1,V2,...`` flags: every combination, the first flag's values
    varying slowest (as itertools.product). Raises SweepError for a flag without ``=``, a key given
    twice, or an empty value."""
    axes: dict[str, list[str]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not _KEY.fullmatch(key):
            raise SweepError(f"--sweep {spec}: write KEY=V1,V2,... (e.g. --sweep lr=3e-4,1e-3)")
        if key in axes:
            raise SweepError(f"--sweep {key} is given twice: put all its values in one --sweep {key}=...")
        split = values.split(",")
        if any(not v.strip() for v in split):
            raise SweepError(f"--sweep {spec}: an empty value; list them as {key}=V1,V2 with none empty")
        axes[key] = [v.strip() for v in split]
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def from_file(path: Path) -> list[Point]:
    """The points of ``--sweep-file``: a YAML list of mappings of key to scalar value (``- {lr: 3e-4,
    seed: 1}``). Raises SweepError when it is unreadable, not such a list, or a value is empty."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"--sweep-file {path}: cannot read it ({e})") from None
    if not isinstance(loaded, list) or not loaded or not all(isinstance(p, dict) and p for p in loaded):
        raise SweepError(
            f"--sweep-file {path}: write a YAML list with one mapping per run, e.g. - {{lr: 3e-4}}"
        )
    points = []
    for k, point in enumerate(loaded):
        for key, value in point.items():
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise SweepError(f"--sweep-file {path}: run {k}: {key!r} is not a key (letters, digits, _ -)")
            if value is None or isinstance(value, dict | list) or not str(value).strip():
                raise SweepError(f"--sweep-file {path}: run {k}: {key} needs one value (a number or a word)")
        points.append({key: str(value) for key, value in point.items()})
    return points


def check_count(points: list[Point], yes: bool) -> None:
    """Raises SweepError for an empty sweep, or one of over MAX_POINTS runs without ``--yes``."""
    if not points:
        raise SweepError("the sweep has no runs: give --sweep KEY=V1,V2 or --sweep-file")
    if len(points) > MAX_POINTS and not yes:
        raise SweepError(
            f"the sweep makes {len(points):,} runs, over {MAX_POINTS:,}: check it, then add --yes"
        )


def trainer_args(args: list[str], point: Point, flags: set[str]) -> list[str]:
    """The built-in trainer's arguments of the run at ``point``: ``args`` then ``--KEY VALUE`` for
    each key (argparse keeps the last: a value swept overrides one given once; ``max_steps`` and
    ``max-steps`` are ``--max-steps``). ``flags``: the trainer's own. Raises SweepError for a key that
    is not one of its flags."""
    out = list(args)
    for key, value in point.items():
        flag = "--" + key.replace("_", "-")
        if flag not in flags:
            raise SweepError(f"--sweep {key}: the trainer has no flag {flag} (see `trainer train --help`)")
        out += [flag, value]
    return out


def program_args(args: list[str], point: Point) -> list[str]:
    """A user's program's arguments of the run at ``point``: each ``{KEY}`` replaced by its value (as
    Hydra's and W&B's sweeps do). Raises SweepError for a placeholder the point has no value for, or a
    key no argument uses."""
    used = {name for arg in args for name in PLACEHOLDER.findall(arg)}
    if missing := sorted(used - point.keys()):
        raise SweepError(
            f"the program's arguments use {{{missing[0]}}}, which no --sweep gives a value: add "
            f"--sweep {missing[0]}=V1,V2 or drop the placeholder"
        )
    if unused := [key for key in point if key not in used]:
        raise SweepError(
            f"--sweep {unused[0]}: no argument of the program says {{{unused[0]}}}; write it where the "
            f"value goes (e.g. --{unused[0]} {{{unused[0]}}})"
        )
    return [PLACEHOLDER.sub(lambda m: point[m.group(1)], arg) for arg in args]


def run_dir_args(args: list[str], index: int) -> list[str]:
    """The trainer's arguments with an explicit ``--run-dir DIR`` made ``DIR/run-<index>``: two runs
    of a sweep never share a run dir (its lock would stop the second; each resumes its own)."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--run-dir" and i + 1 < len(out):
            out[i + 1] = f"{out[i + 1].rstrip('/')}/run-{index}"
        elif arg.startswith("--run-dir="):
            out[i] = f"{arg.rstrip('/')}/run-{index}"
    return out


def describe(point: Point) -> str:
    """``lr=3e-4 seed=1``: a run's values in one word each."""
    return " ".join(f"{k}={v}" for k, v in point.items())
