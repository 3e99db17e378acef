"""The console's lines about a job's attempts, from its record and rank 0's beats (never its logs).

Each attempt's start-up is named as it goes (``launcher.job.startup``): a part that lasts (a compile)
once it has run a few seconds, with the seconds it is expected to take where the program knows them,
then every part's seconds at the first step. When an attempt fails and the job retries, a followed job
shows one line saying what failed, where and at which step, and when the next attempt starts (the
supervisor's own status line); once that attempt's rank 0 beats, one more says the step it resumed at
(from the beat: a script's own checkpoint is known only to it)::

    launcher: start-up: compile (3 s so far, about 38 s expected)
    launcher: first step 44.2 s after the start: launch 4.1 s, data 0.6 s, rendezvous 0.1 s, ...
    launcher: attempt 1 at step 32: node 1 (host gl-h2) failed: ...; attempt 2 of 3 starts now
    launcher: attempt 2 of 3 resumed at step 30
    launcher: first step 6.0 s after the start of attempt 2: launch 2.2 s, ...
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gptlaunch.contract import Beat
from launcher.job import startup
from launcher.job.goodput import archived_beat, rank0
from launcher.job.record import Attempt, JobRecord
from launcher.job.retry import backoff_s, next_in
from launcher.job.survivors import HOLD_S

READ_EVERY_S = 1.0  # how often the job's status is read (seconds)


class Announcer:
    """Reads the job's status every READ_EVERY_S; ``lines()`` returns what to show now."""

    def __init__(self, record: JobRecord, beats: Callable[[], dict[int, list[Beat]]]) -> None:
        """``beats``: the ranks' beats by node (``Scheduler.heartbeats``), asked in a thread of its own:
        SSH hosts may take seconds to answer while a job retries, and the console must not wait."""
        spec = record.spec()
        self.record, self.beats = record, beats
        self._asking: threading.Thread | None = None
        self._answer: dict[int, list[Beat]] = {}
        self.total, self.backoff_base_s = spec.retries + 1, spec.retry_backoff_s
        self.seen = len(record.status().attempts)  # a follower that starts late says only what is new
        self.waiting: Attempt | None = None  # the last failed attempt, until the next one resumes
        self.next_read = 0.0
        self.since = time.time()  # a start-up that ended before this follower started is not said
        self.started: float | None = None  # the start of the attempt whose start-up was said whole
        self.part: tuple[float, str] | None = None  # (its attempt's start, part): the last part said
        self.held: list[tuple[float, str]] = []  # (monotonic seconds when due, a start-up line)

    def lines(self, final: bool = False) -> list[str]:
        """What to say now; ``final``: once the job's output ended, what is left (the beats asked here
        and waited for: nothing calls again)."""
        out = self._read(final) if final or time.monotonic() >= self.next_read else []
        due = [line for at, line in self.held if final or at <= time.monotonic()]
        self.held = self.held[len(due) :]
        return out + due

    def _read(self, final: bool) -> list[str]:
        """The retry lines due now; the start-up's go to ``held``."""
        self.next_read = time.monotonic() + READ_EVERY_S
        out = []
        status = self.record.status()
        attempts = status.attempts if self.total > 1 else []
        for k, attempt in enumerate(attempts[self.seen :], start=self.seen):
            wait_s = backoff_s(self.backoff_base_s, attempts[: k + 1])
            out += self._ended_startup(attempt)
            out.append(f"launcher: {next_in(attempt, self.total - 1, wait_s)}")
            self.waiting = attempt
        self.seen = max(self.seen, len(attempts))
        begun = status.attempt_started_at or status.started_at  # the running attempt's start
        between = bool(status.attempts) and begun is not None and begun <= status.attempts[-1].ended_at
        starting = begun is not None and begun != self.started and not between  # not an ended one's
        if not (starting or self.waiting is not None) or (beats := self._answered(final)) is None:
            return out
        beat = rank0(beats)
        if self.waiting is not None and beat is not None and _after(beat, self.waiting):
            number, start = self.waiting.number + 1, beat.start_step
            how = f"resumed at step {start:,}" if start else "started at step 0"
            out.append(f"launcher: attempt {number} of {self.total} {how}")
            self.waiting = None
        # Shown as late as the ranks' lines are (``launcher.job.survivors``): in their order.
        if begun is not None and starting:
            self.held += [
                (time.monotonic() + HOLD_S, line) for line in self._startup(status.attempt, begun, beat)
            ]
        return out

    def _startup(self, number: int, begun: float, beat: Beat | None) -> list[str]:
        """The start-up of attempt ``number``, running since ``begun`` (epoch seconds): a part that has
        lasted SAY_AFTER_S (once each), then all of them at its first step."""
        now_in = startup.current(beat, begun, time.time())
        if now_in is None and beat is not None:  # its first step
            return self._first_step(number, begun, beat)
        if now_in is None or now_in[1] < startup.SAY_AFTER_S or self.part == (begun, now_in[0]):
            return []
        self.part = (begun, now_in[0])
        return [startup.progress_line(*now_in)]

    def _first_step(self, number: int, begun: float, beat: Beat) -> list[str]:
        """Every part of the start-up of attempt ``number`` (begun at ``begun``, epoch seconds) once
        ``beat`` shows its first step: said once per attempt, and not for a start-up that ended before
        this follower started."""
        self.started = begun
        found = startup.parts(beat, begun)
        line = f"launcher: {startup.first_step(found, number)}"
        return [] if begun + sum(found.values()) < self.since else [line]

    def _ended_startup(self, attempt: Attempt) -> list[str]:
        """Before the line of an attempt that ended: the start-up lines still held, and its first
        step's line if not said yet (a failure soon after its first step, within a read or two), from
        its archived beat (none if it never got that far)."""
        held, self.held = [line for _, line in self.held], []  # said now, before the failure's line
        if self.started == attempt.started_at:
            return held
        beat = archived_beat(self.record.dir, attempt.number)
        if beat is None or not startup.stepped(beat, attempt.started_at):
            return held
        return held + self._first_step(attempt.number, attempt.started_at, beat)

    def _ask(self) -> None:
        try:
            self._answer = self.beats()
        except Exception:  # a host that cannot answer now (or a plan being rewritten): asked again later
            self._answer = {}

    def _answered(self, wait: bool = False) -> list[Beat] | None:
        """Every rank's latest beat, once asked (``wait``: asked now, and waited for); None until then."""
        if wait and self._asking is not None:
            self._asking.join()  # an earlier question's answer: asked again below, and waited for
            self._asking = None
        if self._asking is None:
            self._asking = threading.Thread(target=self._ask, name="announce-beats", daemon=True)
            self._asking.start()
            if wait:
                self._asking.join()
        if self._asking.is_alive():
            return None
        self._asking = None
        return [b for node in self._answer.values() for b in node]


def _after(beat: Beat, ended: Attempt) -> bool:
    """Whether ``beat`` is a step's of the attempt after ``ended`` (written after that attempt was
    cleaned up; a step's: the start-up's beats come before the checkpoint is loaded)."""
    return beat.time > (ended.cleaned_at or ended.ended_at) and beat.phase == "step"
