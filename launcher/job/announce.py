"""The console's lines about a retried job's attempts, from its record (never from its logs).

When an attempt fails and the job retries, a followed job shows one line saying what failed, where
and at which step, and when the next attempt starts (the supervisor's own status line); once that
attempt's rank 0 beats, one more says the step it resumed at (from the beat: a script's own
checkpoint is known only to it)::

    launcher: attempt 1 at step 32: node 1 (host gl-h2) failed: ...; attempt 2 of 3 starts now
    launcher: attempt 2 of 3 resumed at step 30
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gptlaunch.contract import Beat
from launcher.job.goodput import rank0
from launcher.job.record import Attempt, JobRecord
from launcher.job.retry import backoff_s, next_in

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

    def lines(self, final: bool = False) -> list[str]:
        """What to say now; ``final``: once the job's output ended, what is left (the beats asked here
        and waited for: nothing calls again)."""
        if self.total == 1 or (not final and time.monotonic() < self.next_read):
            return []
        self.next_read = time.monotonic() + READ_EVERY_S
        out = []
        attempts = self.record.status().attempts
        for k, attempt in enumerate(attempts[self.seen :], start=self.seen):
            wait_s = backoff_s(self.backoff_base_s, attempts[: k + 1])
            out.append(f"launcher: {next_in(attempt, self.total - 1, wait_s)}")
            self.waiting = attempt
        self.seen = len(attempts)
        if self.waiting is not None and (beat := self._next_attempts_beat(self.waiting, final)) is not None:
            number, start = self.waiting.number + 1, beat.start_step
            how = f"resumed at step {start:,}" if start else "started at step 0"
            out.append(f"launcher: attempt {number} of {self.total} {how}")
            self.waiting = None
        return out

    def _ask(self) -> None:
        try:
            self._answer = self.beats()
        except Exception:  # a host that cannot answer now (or a plan being rewritten): asked again later
            self._answer = {}

    def _next_attempts_beat(self, ended: Attempt, wait: bool = False) -> Beat | None:
        """Rank 0's first beat of a step of the attempt after ``ended`` (written after that attempt was
        cleaned up; a step's: the start-up's beats come before the checkpoint is loaded), once asked
        (``wait``: asked now, and waited for)."""
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
        beat = rank0([b for node in self._answer.values() for b in node])
        since = ended.cleaned_at or ended.ended_at
        return beat if beat is not None and beat.time > since and beat.phase == "step" else None
