"""What a job's report shows, read from its job record and, where this machine can read it, its run
dir: the attempts, goodput, the checks before training, the trainer's metrics, and the files worth
opening (node logs, hang stacks). Nothing here asks a host: a report of an ended job never waits on
hosts that may be gone."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gptlaunch.contract import Beat
from launcher.job import reports, startup
from launcher.job.failures import RUN_COPY
from launcher.job.goodput import Goodput, attempt_beats, goodput_of
from launcher.job.plan import Plan
from launcher.job.record import JobRecord, JobStatus
from launcher.job.retry import ATTEMPTS_DIR
from launcher.job.scalars import read_rank_compute
from launcher.preflight import recorded
from launcher.preflight.recorded import Checks

METRICS = "metrics.jsonl"  # the trainer's, in the run dir (``trainer.metrics``)
REPORT = "report.html"  # in the job directory


@dataclass(frozen=True)
class Span:
    """One attempt on the timeline. Times are epoch seconds; ``ended_at`` None: still running."""

    number: int
    started_at: float
    ended_at: float | None
    outcome: str  # "failed", "running", or the job's terminal state
    cause: str  # one line: the failure's summary; empty for a run that did not fail
    step: int | None  # the furthest step its ranks reported
    moved: str  # hosts replaced or excluded after it, in words (empty: none)
    startup: dict[str, float] = field(default_factory=dict)  # its start-up's parts (``launcher.job.startup``)


@dataclass(frozen=True)
class Mark:
    """A moment on the attempts' timeline: a checkpoint saved, or a hang a node's watchdog found."""

    time: float  # epoch seconds
    kind: str  # "checkpoint" or "hang"
    text: str  # one line


@dataclass(frozen=True)
class Facts:
    """Everything a report shows. ``plan``: the job's id, scheduler, nodes and run dir (as the nodes see
    it); ``metrics``: the trainer's records (None when not readable here, with ``metrics_note`` saying
    why); ``rank_compute``: the launcher's per-rank points of any program (``launcher.job.scalars``);
    ``files``: (label, path relative to the job directory)."""

    plan: Plan
    status: JobStatus
    spans: list[Span]
    marks: list[Mark]
    goodput: Goodput | None
    checks: Checks
    metrics: list[dict[str, Any]] | None
    metrics_note: str
    rank_compute: dict[int, list[tuple[float, float]]]  # rank -> (epoch s, compute s per step), any program
    files: list[tuple[str, str]]
    made_at: float


def gather(record: JobRecord, status: JobStatus, beats: dict[int, list[Beat]], now: float) -> Facts:
    """The facts of ``record``'s job in ``status`` (its scheduler's ``state``), with the last attempt's
    latest beats by node_rank, ``now`` (epoch seconds)."""
    plan = record.plan()
    metrics, note = job_metrics(record)
    each = attempt_beats(record.dir, status, beats)  # read once: the attempts' start-ups and goodput
    return Facts(
        plan=plan,
        status=status,
        spans=with_startup(spans(status, now), each),
        marks=checkpoints(metrics or []) + hangs(record.dir),
        goodput=goodput_of(status, each, now),
        checks=recorded.read(record.dir, plan.nnodes),
        metrics=metrics,
        metrics_note=note,
        rank_compute=read_rank_compute(record.dir),
        files=files(record.dir),
        made_at=now,
    )


def report_path(job_dir: Path) -> Path:
    """Where ``launcher report`` writes the page of the job in ``job_dir``."""
    return job_dir / REPORT


def spans(status: JobStatus, now: float) -> list[Span]:
    """Every attempt of the job, the ended ones from the record, then the last (current) one."""
    found = [
        Span(
            a.number,
            a.started_at,
            a.ended_at,
            "failed",
            a.cause,
            a.step,
            "; ".join([*(f"{old} replaced by {new}" for old, new in a.replaced.items()), *a.excluded]),
        )
        for a in status.attempts
    ]
    if status.started_at is not None:
        terminal = status.state.is_terminal
        found.append(
            Span(
                status.attempt,
                status.attempt_started_at or status.started_at,
                status.ended_at if terminal else None,
                str(status.state) if terminal else "running",
                (status.message or "") if terminal and status.exit_code else "",
                None,
                "",
            )
        )
    return found


def with_startup(found: list[Span], beats: list[Beat | None]) -> list[Span]:
    """``found`` with each attempt's start-up parts, from its rank 0's last beat (``beats``, in the
    same order; None or still starting up: none)."""
    return [
        replace(span, startup=startup.parts(beat, span.started_at))
        if beat is not None and startup.stepped(beat, span.started_at)
        else span
        for span, beat in zip(found, beats, strict=False)
    ]


def checkpoints(metrics: list[dict[str, Any]]) -> list[Mark]:
    """The checkpoints the trainer recorded with their time (``checkpoint_mb`` records)."""
    return [
        Mark(m["time"], "checkpoint", f"checkpoint of step {m['step']:,}: {m['checkpoint_mb']:,.0f} MB, "
             f"the loop stalled {m.get('checkpoint_stall_s', 0.0):.2f} s")
        for m in metrics
        if "checkpoint_mb" in m and isinstance(m.get("time"), int | float)
    ]  # fmt: skip


def hangs(job_dir: Path) -> list[Mark]:
    """Every hang a node's watchdog reported, in every attempt."""
    return [
        Mark(r.time, "hang", f"node {r.node}: {r.hang.summary()}")
        for r in reports.read(job_dir, reports.Hang)
    ]


def job_metrics(record: JobRecord) -> tuple[list[dict[str, Any]] | None, str]:
    """The trainer's records of ``record``'s job: from its run dir, else from the job record's copy of a
    node-local run dir (``RUN_COPY``); None with the reason in words when neither is readable here."""
    metrics, note = read_metrics(Path(record.plan().run_dir))
    if metrics is None and (record.dir / RUN_COPY / METRICS).is_file():
        metrics, note = read_metrics(record.dir / RUN_COPY)
    return metrics, note


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]] | None, str]:
    """The trainer's records in ``run_dir/metrics.jsonl`` (a line cut short by a crash is skipped),
    or None with the reason in words."""
    path = run_dir / METRICS
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None, (
            f"no {METRICS} in {run_dir} on this machine: the program writes none (a script of your own), "
            "or the run dir is on the nodes' own disks"
        )
    except OSError as e:
        return None, f"{path} cannot be read here: {e.strerror}"
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records, "" if records else f"{path} holds no records yet"


def files(job_dir: Path) -> list[tuple[str, str]]:
    """The node logs and hang stacks of each attempt, as (label, path relative to ``job_dir``)."""
    found = []
    numbered = (d for d in (job_dir / ATTEMPTS_DIR).glob("*") if d.name.isdigit())  # not a stray folder
    archived = sorted(numbered, key=lambda d: int(d.name))
    for where, label in [*((d, f"attempt {d.name}") for d in archived), (job_dir, "last attempt")]:
        for path in sorted(where.glob("node-*.log")):
            found.append((f"{label}: {path.stem.replace('-', ' ')} log", str(path.relative_to(job_dir))))
        for path in sorted((where / "hang").glob("*.txt")):
            found.append((f"{label}: hang stack {path.stem}", str(path.relative_to(job_dir))))
    return found
