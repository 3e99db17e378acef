"""The commands on jobs that exist: ``list``, ``status``, ``report``, ``logs``, ``wait`` and
``cancel``, and the one follow loop that attached submits share with them. They read the job record
and ask its scheduler, importing no torch: they answer at once."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from gptlaunch.contract import EXIT_OK, Beat
from launcher.cli.flags import UsageError
from launcher.job.aftermath import quieted
from launcher.job.announce import Announcer
from launcher.job.collapse import collapsed
from launcher.job.console import say
from launcher.job.goodput import job_goodput
from launcher.job.logs import TICK
from launcher.job.progress import last_step, node_progress, recorded_beats
from launcher.job.record import JobError, JobRecord, JobStatus, list_jobs
from launcher.job.scalars import scalars_dir, tensorboard_command
from launcher.job.survivors import left_to_logs
from launcher.report.facts import gather, report_path
from launcher.schedulers.base import Scheduler
from launcher.sweep.record import scheduler_of
from launcher.sweep.table import list_rows


def follow(
    scheduler: Scheduler[Any],
    record: JobRecord,
    out: TextIO | None,
    node: int | None = None,
    attached: bool = False,
    keep: Callable[[str], bool] = lambda line: True,
    console: bool = False,
) -> JobStatus:
    """The one follow loop (attached submit, ``logs --follow``, ``wait``): copy the job's node-prefixed
    output to ``out`` (None: discard it) until the job reaches a terminal state; return that status.
    If ``out`` closes (``| head``, a closed terminal), an ``attached`` submit follows on quietly (it
    owns the job), anything else stops following and returns the status then. ``keep`` picks the lines
    shown (``launcher.job.console.console_lines``). ``console`` (an attached submit, ``--wait``, not
    ``logs -f``): the lines pass the console's stages, each described in its module
    (``launcher.job.aftermath``, ``collapse``, ``survivors``: each line shown HOLD_S late, ``announce``)."""
    lines = scheduler.logs(record, node, follow=True)
    if console:  # the tracebacks that follow from a failure left to the logs, each judged whole
        lines = quieted(lines)
    lines = (line for line in lines if line == TICK or keep(line))
    if console:  # alike lines merged while they are held anyway
        lines = left_to_logs(collapsed(lines), record.status)
        lines = _announced(lines, Announcer(record, lambda: scheduler.heartbeats(record)))
    _copy(lines, out, attached)
    return scheduler.state(record)


def _announced(lines: Iterator[str], announcer: Announcer) -> Iterator[str]:
    """``lines``, with the announcer's lines about the attempts said (stderr) as they come."""
    for line in lines:
        for said in announcer.lines():
            say(said)
        yield line
    for said in announcer.lines(final=True):  # an attempt that resumed and ended between two reads
        say(said)


def _copy(lines: Iterator[str], out: TextIO | None, keep_reading: bool = False) -> None:
    """Write ``lines`` to ``out``; when ``out`` breaks, stop (or, ``keep_reading``, drain quietly)."""
    for line in lines:
        if out is None:
            continue
        try:
            out.write(line)
            out.flush()
        except OSError:
            out = None
            silence_stdout()
            if not keep_reading:
                return


def silence_stdout() -> None:
    """After stdout broke, point it at /dev/null so that Python's exit-time flush stays quiet."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def ended(job_id: str, status: JobStatus) -> int:
    """Say how the job ended (stderr); return its exit code."""
    took = (status.ended_at or time.time()) - (status.started_at or status.created_at)
    detail = f": {status.message}" if status.message else ""
    say(f"launcher: job {job_id} {status.state} after {took:.1f} s{detail}")
    return status.job_exit_code


def _open(args: argparse.Namespace) -> tuple[JobRecord, Scheduler[Any]]:
    """The job and its scheduler; a record of another launcher version is refused (RecordError, exit 2)
    before anything is asked of the job, rather than half-way (`wait` would read as the job failed)."""
    record = JobRecord.open(args.job, args.jobs_root)
    record.check()
    return record, scheduler_of(record)


def cmd_list(args: argparse.Namespace) -> int:
    print(f"{'JOB ID':40} {'STATE':13} {'NODES':>5} {'PROCS':>5} {'CREATED (UTC)':20} {'SECONDS':>8}")
    for record in list_jobs(args.jobs_root):
        try:
            record.check()
            plan = record.plan()
            st = scheduler_of(record).state(record)
        except (OSError, ValueError, JobError) as e:  # RecordError is a JobError
            # One row still, so that the job shows up (to be removed); why, in one line on stderr.
            say(f"launcher: unreadable job record {record.dir.name}: {e}")
            print(f"{record.dir.name:40} {'unreadable':13} {'-':>5} {'-':>5} {'-':20} {'-':>8}")
            continue
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(st.created_at))
        secs = f"{(st.ended_at or time.time()) - st.started_at:.0f}" if st.started_at else "-"
        print(
            f"{plan.job_id:40} {st.state:13} {plan.nnodes:>5} {plan.nproc_per_node:>5} {created:20} {secs:>8}"
        )
    for row in list_rows(args.jobs_root):  # a sweep: one line, its runs by state
        print(row)
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    record, scheduler = _open(args)
    st, plan = scheduler.state(record), record.plan()
    # Per node while it runs: step, heartbeat age, stall and stragglers (where the beats are readable).
    beats = _beats(scheduler, record, st)
    nodes = [] if st.state.is_terminal else node_progress(plan, record.spec().hang, beats, time.time())
    goodput = job_goodput(record.dir, st, beats, time.time())
    reached = last_step(beats)  # the last attempt's
    page = report_path(record.dir)
    report = page if page.is_file() else None
    if args.json:
        extra = {
            "nodes": [n.model_dump(mode="json") for n in nodes],
            "last_step": reached,
            "goodput": goodput and {**goodput.model_dump(), "ratio": goodput.ratio},
            "report": report and str(report),
        }
        print(json.dumps({**st.model_dump(mode="json"), **extra}, indent=2))
        return EXIT_OK
    print(f"job {plan.job_id}: {st.state}")
    print(f"  scheduler {plan.scheduler}, {plan.nnodes} node(s) × {plan.nproc_per_node}, record {record.dir}")
    print(f"  run dir {plan.run_dir}")
    if st.state.is_terminal:
        print(f"  exit code {st.job_exit_code}: {st.message or st.state}")
        if reached is not None:
            print(f"  last step {reached:,} (the furthest any rank reached)")
    elif st.message:
        print(f"  {st.message}")
    retries = record.spec().retries
    if retries:
        print(f"  attempt {st.attempt} of {retries + 1}")
    for attempt in st.attempts:
        print(f"    {attempt.describe()}")
    for node in nodes:
        print(f"  {node.describe()}")
    if goodput is not None:
        print(f"  {goodput.describe()}")
    if scalars_dir(record.dir).is_dir():
        print(f"  TensorBoard: {tensorboard_command(record.dir, plan.run_dir)}")
    if report is not None:
        print(f"  report {report} (`launcher report {plan.job_id}` makes it anew)")
    return EXIT_OK


def _beats(scheduler: Scheduler[Any], record: JobRecord, status: JobStatus) -> dict[int, list[Beat]]:
    """The ranks' latest beats by node rank. Running: from the nodes (SSH asks each host). Ended: only
    what the job record holds, so that an old job's status never waits on hosts that may be gone."""
    if status.state.is_terminal:
        return recorded_beats(record.plan(), record.dir)
    return scheduler.heartbeats(record)


def cmd_report(args: argparse.Namespace) -> int:
    """Write the job's report page into its record and print its path."""
    from launcher.report.page import render, write  # plotly: only this command pays its import

    record, scheduler = _open(args)
    st = scheduler.state(record)
    print(write(record.dir, render(gather(record, st, _beats(scheduler, record, st), time.time()))))
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    record, scheduler = _open(args)
    if args.node is not None and not 0 <= args.node < record.plan().nnodes:
        raise UsageError(f"--node {args.node}: the job has nodes 0..{record.plan().nnodes - 1}")
    if args.follow:
        follow(scheduler, record, sys.stdout, args.node)
    else:
        _copy(scheduler.logs(record, args.node, follow=False), sys.stdout)
    return EXIT_OK


def cmd_wait(args: argparse.Namespace) -> int:
    record, scheduler = _open(args)
    return ended(record.job_id, follow(scheduler, record, None))


def cmd_cancel(args: argparse.Namespace) -> int:
    record, scheduler = _open(args)
    status = scheduler.cancel(record)
    print(f"job {record.job_id}: {status.state}" + (f" ({status.message})" if status.message else ""))
    return EXIT_OK
