"""The job's own numbers in TensorBoard, beside the trainer's loss: goodput and its parts over time, and
each attempt's start with the cause of the failure before it. The job's controller (on SLURM, in the
allocation) writes them into ``<job dir>/tensorboard/job`` with TensorBoard's own event writer and
protos: no torch import in a process that lives as long as the job (``tensorboard.summary.v1``'s helpers
need TensorFlow; the event writer imports it only where it is installed). Nothing here ever stops or
fails the job: a write that fails (no tensorboard, a full disk) is logged once, and no more points are
written.

TensorBoard's horizontal "step" here is whole seconds since the job was submitted; each point's wall
time is when it was measured. The tags, their units and how to open them beside the trainer's run:
``docs/report.md`` (In TensorBoard, beside the loss).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gptlaunch.contract import Beat
from launcher.job.goodput import Goodput, job_goodput, rank0
from launcher.job.measurements import CollectiveResult
from launcher.job.plan import Plan
from launcher.job.progress import recorded_beats, stragglers
from launcher.job.record import JobRecord, JobStatus

if TYPE_CHECKING:  # imported where written: `launcher status` only names the dir, and answers at once
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

SAMPLE_S = 15.0  # seconds between two goodput points while an attempt runs
PARTS = ("training_s", "startup_s", "lost_s", "checkpoint_s", "eval_s", "other_s", "wall_s")
Point = tuple[str, float | str]  # (tag, value): a number is a scalar, a string a line of text


def scalars_dir(job_dir: Path) -> Path:
    """Where the job-level event file of the job in ``job_dir`` is."""
    return job_dir / "tensorboard" / "job"


def tensorboard_command(job_dir: Path, run_dir: str) -> str:
    """The command that shows the job's scalars with the trainer's (those in ``run_dir`` on this
    machine): one ``--logdir`` when the run dir is inside the job directory, else a run name each."""
    job, run = job_dir.resolve(), Path(run_dir).resolve()
    if run.is_relative_to(job):
        return f"tensorboard --logdir {job}"
    return f"tensorboard --logdir_spec job:{scalars_dir(job)},trainer:{run / 'tensorboard'}"


class JobScalars:
    """The job-level event file of the job in ``job_dir``, submitted at ``origin`` (epoch seconds)."""

    def __init__(self, job_dir: Path, origin: float) -> None:
        self.origin = origin
        self.next_sample = 0.0  # time.monotonic() of the next periodic goodput point
        self._writer: EventFileWriter | None = None
        with self._guard():
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            scalars_dir(job_dir).mkdir(parents=True, exist_ok=True)
            self._writer = EventFileWriter(str(scalars_dir(job_dir)))

    def attempt(self, number: int, total: int, before: str, at: float) -> None:
        """Attempt ``number`` of ``total`` started at ``at``; ``before``: why the previous one ended
        (empty for the first)."""
        line = f"attempt {number} of {total} started" + (f" after: {before}" if before else "")
        self._add(at, [("job/attempt", number), ("job/failures", number - 1), ("job/attempts", line)])

    def goodput(self, goodput: Goodput, at: float, attempt: int) -> None:
        """A point of goodput and its parts, measured at ``at`` during ``attempt`` (also a point of
        ``job/attempt``: a line, where two points at the attempts' starts would hardly show)."""
        points: list[Point] = [("job/attempt", attempt), ("goodput/ratio", goodput.ratio)]
        self._add(at, points + [(f"goodput/{part}", getattr(goodput, part)) for part in PARTS])

    def ranks(self, beats: list[Beat], at: float) -> None:
        """The ranks' compute seconds per step as of their ``beats``, its spread and the straggler flags
        (``ranks/*``: see ``docs/report.md``); nothing before a rank is timed."""
        with self._guard():  # a malformed beat ends the points, never the job
            timed = {b.rank: float(b.compute_s) for b in beats if b.compute_s}
            if not timed:
                return
            named = stragglers(beats)
            points: list[Point] = [(f"ranks/compute_s/rank_{rank}", s) for rank, s in sorted(timed.items())]
            points += [(f"ranks/straggler/rank_{rank}", float(rank in named)) for rank in sorted(timed)]
            spread = max(timed.values()) / min(timed.values())
            points += [("ranks/stragglers", len(named)), ("ranks/compute_spread", spread)]
            self._add(at, points)

    def health(self, result: CollectiveResult, hosts: list[str], at: float) -> None:
        """The health gate's figures (``launcher.preflight.health``) at ``at``: each pair's bus
        bandwidth (``health/busbw_gbs/<host>-<host>``, GB/s) and each rank's matmul throughput
        (``health/tflops/<host>-rank_K``, TFLOP/s). ``hosts``: the node names by node rank."""
        if not self.active:
            return
        with self._guard():
            points: list[Point] = [
                (f"health/busbw_gbs/{hosts[p.nodes[0]]}-{hosts[p.nodes[1]]}", p.busbw_gbs)
                for p in result.pairs
            ]
            points += [(f"health/tflops/{hosts[d.node]}-rank_{d.rank}", d.tflops) for d in result.compute]
            self._add(at, points)

    @property
    def active(self) -> bool:
        """Whether points are still written (no write failed)."""
        return self._writer is not None

    def close(self) -> None:
        """Flush and close the event file."""
        with self._guard():
            if self._writer is not None:
                self._writer.close()

    def _add(self, at: float, points: list[Point]) -> None:
        """Write ``points`` as of ``at``, then flush once: a user's TensorBoard sees them now. A number
        is a plain scalar (``simple_value``, what ``read_rank_compute`` reads back), a string one line of
        TensorBoard's text dashboard (a string tensor of shape (1,), as its own text summaries are)."""
        with self._guard():
            if self._writer is None:
                return
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.plugins.text.summary_v2 import text_pb

            step = max(0, int(at - self.origin))
            for tag, value in points:
                if isinstance(value, str):
                    summary = text_pb(tag, [value])
                else:
                    summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
                self._writer.add_event(Event(wall_time=at, step=step, summary=summary))
            self._writer.flush()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Any error in the block ends the points, once, with a warning: never the job."""
        try:
            yield
        except Exception as e:
            logging.getLogger(__name__).warning("job scalars in TensorBoard: none from now on: %s", e)
            self._writer = None


def read_rank_compute(job_dir: Path) -> dict[int, list[tuple[float, float]]]:
    """Each rank's compute seconds per step as the job's event files hold them (``ranks/compute_s``),
    by rank: (epoch seconds, seconds) in time order. Empty when there are none, or they cannot be read
    (no tensorboard installed, no event file yet)."""
    directory = scalars_dir(job_dir)
    if not directory.is_dir():
        return {}
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        events.Reload()
        prefix = "ranks/compute_s/rank_"
        tags = [t for t in events.Tags()["scalars"] if t.startswith(prefix)]
        return {int(t[len(prefix) :]): [(e.wall_time, e.value) for e in events.Scalars(t)] for t in tags}
    except Exception as e:  # a report says in words what it cannot show; it never fails for it
        logging.getLogger(__name__).warning("job scalars in TensorBoard: not read: %s", e)
        return {}


def goodput_point(
    scalars: JobScalars,
    record: JobRecord,
    plan: Plan,
    *,
    periodic: bool,
    status: JobStatus | None = None,
) -> None:
    """A goodput point, and the ranks' (``JobScalars.ranks``), from what the job record holds now. A
    periodic one (every SAMPLE_S) only where the running attempt's ranks beat in the record (local
    nodes, SLURM, compose; an SSH host's beats reach it when its attempt ends): without them the running
    attempt would count as not training. ``status``: the job's status to tell it from, where the record
    does not hold it yet (an end about to be recorded)."""
    if not scalars.active or (periodic and time.monotonic() < scalars.next_sample):
        return
    if periodic:
        scalars.next_sample = time.monotonic() + SAMPLE_S
    try:
        beats = recorded_beats(plan, record.dir)
        if periodic and rank0([b for node in beats.values() for b in node]) is None:
            return
        now = time.time()
        status = status or record.status()
        goodput = job_goodput(record.dir, status, beats, now)
    except Exception as e:  # e.g. a beat of another version: the next point may do
        logging.getLogger(__name__).warning("job scalars in TensorBoard: goodput not read: %s", e)
        return
    if goodput is not None:
        scalars.goodput(goodput, now, status.attempt)
    scalars.ranks([b for node in beats.values() for b in node], now)
