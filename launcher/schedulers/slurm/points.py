"""A SLURM job's own numbers in TensorBoard (``launcher.job.scalars``: the tags, and the supervisor
that writes them elsewhere). No launcher lives during a SLURM job, so node 0's task writes them into
the job record that the nodes share, beside the trainer's curves:

- at its attempt's start: the attempt, with the cause of the failure before it (``job/attempts``),
  and the health gate's figures when the gate step of this run recorded them;
- every ``SAMPLE_S`` while its ranks run: goodput and its parts, the ranks' compute times and the
  straggler flags, from the ranks' beats in the job record;
- once more when its ranks ended.

SLURM's start of the job (``SLURM_JOB_START_TIME``, or this task's start when SLURM does not say it)
stands in for the recorded one, which only ``launcher status`` writes (from ``sacct``). Best effort,
as everywhere: a record this task cannot read (the standalone sbatch script keeps no spec) or write
writes no point, and never fails the node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

from launcher.job.plan import Plan
from launcher.job.record import JobRecord
from launcher.job.scalars import SAMPLE_S, JobScalars, goodput_point
from launcher.preflight import recorded


class AttemptPoints:
    """Node 0's points of the job in ``job_dir`` for the attempt that starts now (``start``) until
    its ranks end (``stop``): a thread of its own, off the ranks' way."""

    def __init__(self, job_dir: Path) -> None:
        self.record = JobRecord(job_dir)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """The attempt's first points, then a point every SAMPLE_S; nothing when the record has no
        spec or status (the standalone sbatch script)."""
        try:
            status, spec, plan = self.record.status(), self.record.spec(), self.record.plan()
        except Exception as e:  # missing (OSError), of another version (ValueError): never the node's end
            logging.getLogger(__name__).info("job scalars in TensorBoard: none for this record: %s", e)
            return
        now = time.time()
        job_started = float(os.environ.get("SLURM_JOB_START_TIME") or now)
        scalars = JobScalars(self.record.dir, status.created_at)
        before = next((a.cause for a in status.attempts if a.number == status.attempt - 1), "")
        scalars.attempt(status.attempt, spec.retries + 1, before, now)
        with contextlib.suppress(Exception):  # a gate result of another version: no health points
            checks = recorded.read(self.record.dir, plan.nnodes)
            if checks.health is not None:
                scalars.health(checks.health, checks.hosts, now)
        self._thread = threading.Thread(target=self._run, args=(scalars, plan, job_started), daemon=True)
        self._thread.start()

    def _run(self, scalars: JobScalars, plan: Plan, job_started: float) -> None:
        while not self._done.wait(SAMPLE_S):  # Event.wait: monotonic, so each point is due
            goodput_point(scalars, self.record, plan, periodic=True, started_at=job_started)
        goodput_point(scalars, self.record, plan, periodic=False, started_at=job_started)
        scalars.close()

    def stop(self) -> None:
        """The ranks ended: the last point (goodput as of now), and the event file closed."""
        if self._thread is not None:
            self._done.set()
            self._thread.join()
