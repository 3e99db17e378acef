"""An attempt's start-up in parts, from its rank 0's beat: what the console and the job's report say.

Before its first step a rank names what it is doing (``gptlaunch.runtime.starting``: the built-in
trainer's data, rendezvous, setup and compile, with the compile's expected seconds); everything from
the attempt's start to the first part it named is the launch (the node agents, torchrun and its
rendezvous, the interpreters and their imports). A program that names no part has only the launch.
"""

from __future__ import annotations

from gptlaunch.contract import Beat
from launcher.job.goodput import STARTUP, first_step_at

LAUNCH = "launch"
SAY_AFTER_S = 2.0  # a part the console names while it runs, once it has lasted this long (seconds)


def parts(beat: Beat, started_at: float) -> dict[str, float]:
    """Seconds of each part of the start-up of the attempt that started at ``started_at`` (epoch
    seconds), whose rank 0's latest beat is ``beat``: the launch first, then the parts the program named
    in order; to the first step, or to the beat while it still starts up."""
    named = sum(beat.startup_s.values())
    return {LAUNCH: max(0.0, first_step_at(beat) - named - started_at), **beat.startup_s}


def stepped(beat: Beat, started_at: float) -> bool:
    """Whether ``beat`` is of the attempt that started at ``started_at`` (epoch seconds), past its first
    step."""
    return beat.time > started_at and beat.phase != STARTUP


def current(beat: Beat | None, started_at: float, now: float) -> tuple[str, float, float | None] | None:
    """(part, its seconds so far, its expected seconds or None) of the start-up of the attempt that
    started at ``started_at``, at ``now`` (epoch seconds), from its rank 0's latest ``beat`` (None, or
    an earlier attempt's: none yet, so the launch); None once that attempt took its first step."""
    if beat is not None and stepped(beat, started_at):
        return None
    if beat is None or beat.time <= started_at or not beat.startup_s:
        return LAUNCH, now - started_at, None
    part = list(beat.startup_s)[-1]
    return part, beat.startup_s[part] + max(0.0, now - beat.time), beat.expect_s


def progress_line(part: str, seconds: float, expect_s: float | None) -> str:
    """``launcher: start-up: compile (3 s so far, about 38 s expected)``."""
    expected = f", about {expect_s:.0f} s expected" if expect_s is not None else ""
    return f"launcher: start-up: {part} ({seconds:.0f} s so far{expected})"


def first_step(found: dict[str, float], attempt: int = 1) -> str:
    """``first step 13.4 s after the start: launch 8.1 s, data 0.1 s, rendezvous 0.1 s, setup 1.4 s,
    compile 3.7 s`` (``... after the start of attempt 2: ...`` for a later attempt); no parts when only
    the launch is known (a program that named no part)."""
    start = "the start" if attempt == 1 else f"the start of attempt {attempt}"
    line = f"first step {sum(found.values()):.1f} s after {start}"
    if list(found) in ([], [LAUNCH]):
        return line
    return f"{line}: " + ", ".join(f"{part} {seconds:.1f} s" for part, seconds in found.items())
