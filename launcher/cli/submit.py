"""``launcher submit`` and ``launcher render``: the trainer's arguments checked, the Plan rendered,
the record written, the job handed to its scheduler and, attached, followed to its end. User mistakes
raise UsageError (exit 2) before anything is written."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from gptlaunch.contract import EXIT_INTERRUPTED, EXIT_OK
from launcher.cli.flags import UsageError, build_spec
from launcher.cli.jobs import ended, follow
from launcher.job.console import Tee, console_lines, say, shows_all
from launcher.job.plan import Plan, UnresolvedHosts
from launcher.job.record import JobRecord, JobStatus, new_job_id
from launcher.job.spec import JobSpec, check_text
from launcher.schedulers import get_scheduler
from launcher.schedulers.base import Scheduler
from launcher.supervisor import procs


def check_trainer_args(spec: JobSpec, workdir: Path, files_here: bool) -> None:
    """Validate the trainer's arguments before anything is written or started: flags, values, that the
    global batch splits over this job's world_size and, when the nodes see this machine's files
    (``files_here``), the data files and resume checkpoint. Raises UsageError."""
    from trainer.precheck import InvalidTrainerArgs, check_train_args

    if (program := spec.program) is not None:  # a script that the nodes would not find: named now
        if program.kind == "script" and files_here and not (workdir / program.target).is_file():
            raise UsageError(
                f"program: {program.target} is not a file in the working directory {workdir}; fix: give the "
                "script's path relative to it (--workdir), or run the launcher from the script's directory"
            )
        return
    # Relative paths among them are the trainer's, resolved in its working directory (when it is here).
    where = contextlib.chdir(workdir) if files_here else contextlib.nullcontext()
    try:
        with where:
            check_train_args(spec.trainer_args, world_size=spec.world_size, files_here=files_here)
    except InvalidTrainerArgs as e:
        raise UsageError(f"trainer arguments: {e}") from None
    except SystemExit as e:
        if e.code == 0:  # `-- --help` printed the trainer's help
            raise
        # argparse already printed which flag it did not know
        raise UsageError("trainer arguments are not valid (see above and `trainer train --help`)") from e


def _plan(
    args: argparse.Namespace, trainer_args: list[str], dry_run: bool = False
) -> tuple[JobSpec, Scheduler[Any], Plan, Path, list[str]]:
    """The job's spec, scheduler, Plan and record directory, after every check that starts nothing,
    and (``dry_run`` only) the hosts that do not resolve here, whose checks could not run: a dry run
    prints the Plan with them marked, where a submit refuses it. Raises UsageError, SpecError."""
    try:
        check_text(str(args.jobs_root), "--jobs-root")
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec = build_spec(args, trainer_args)
    scheduler = get_scheduler(spec.scheduler.kind)
    if not scheduler.files_here:  # no local file is read: check before the nodes' (slow) checks and pulls
        check_trainer_args(spec, Path.cwd(), files_here=False)
    unresolved: list[str] = []
    try:
        facts = scheduler.resolve(spec)
    except UnresolvedHosts as e:
        if not dry_run or e.facts is None:
            raise
        facts, unresolved = e.facts, e.hosts
    if scheduler.files_here:
        check_trainer_args(spec, Path(facts.workdir), files_here=True)
    job_id = getattr(args, "job_id", None) or new_job_id(spec.name)  # a sweep names its runs
    job_dir = (spec.job_dir or args.jobs_root / job_id).absolute()
    return spec, scheduler, scheduler.render(spec, facts, job_id, job_dir), job_dir, unresolved


def _check_new(job_dir: Path) -> None:
    """Raises UsageError when ``job_dir`` is not a place for a new job's record."""
    try:
        JobRecord.check_new(job_dir)
    except FileExistsError as e:
        raise UsageError(str(e)) from None


def plan_and_print(args: argparse.Namespace, trainer_args: list[str], check_new: bool = False) -> int:
    """``render``: print the Plan of a job of ``trainer_args`` (a sweep's dry run: each run's), or one
    file of it (``--file``). Hosts that do not resolve here: their nodes marked and, after it, a
    UsageError (exit 2) that names them and the fix. ``check_new`` (``submit --dry-run``): first a
    UsageError when the job's directory is not a place for a new record, as the submit would say."""
    _, _, plan, job_dir, unresolved = _plan(args, trainer_args, dry_run=True)
    if check_new:
        _check_new(job_dir)
    if args.file is not None:
        if args.file not in plan.files:
            names = ", ".join(sorted(plan.files)) or "no file"
            raise UsageError(f"--file {args.file}: the Plan has {names}; pass one of them or drop --file")
        print(plan.files[args.file].rstrip("\n"))
    elif args.json:
        print(plan.to_json())
    else:
        text = plan.to_text()
        for host in unresolved:  # their nodes' headers marked
            text = text.replace(f" on {host} (log:", f" on {host} (DOES NOT RESOLVE HERE; log:")
        print(text.rstrip("\n"))
    if unresolved:
        raise UsageError(
            f"{len(unresolved)} host(s) do not resolve here: {', '.join(unresolved)}. The plan above is "
            "unchecked (no parity, no interface chosen, the rendezvous port not probed); `launcher "
            "submit` refuses it until they resolve: check the names, /etc/hosts or ~/.ssh/config"
        )
    return EXIT_OK


def cmd_submit(args: argparse.Namespace, trainer_args: list[str]) -> int:
    if args.detach and args.wait:  # a dry run too refuses what the submit would
        raise UsageError("--detach and --wait contradict each other: keep one")
    if args.dry_run:
        return plan_and_print(args, trainer_args, check_new=True)
    if args.file is not None:
        raise UsageError("--file prints a file of the Plan: add --dry-run (or use `launcher render`)")
    scheduler, plan, record = prepare(args, trainer_args)
    if args.detach or scheduler.queued:
        return _submit_detached(scheduler, plan, record, args.wait, args.tee)
    say(
        f"launcher: job {plan.job_id}: {plan.nnodes} node(s) × {plan.nproc_per_node} process(es) on "
        f"{plan.scheduler}; record {record.dir}; run dir {plan.run_dir}"
    )
    keep = _console(args.tee, plan, record.dir)
    with _CancelOnSignal(scheduler, record) as stopper:
        _submit_or_discard(scheduler, plan, record, detach=False)
        stopper.job_started()
        final = follow(scheduler, record, sys.stdout, attached=True, keep=keep, console=True)
    return ended(plan.job_id, final)


def checked(args: argparse.Namespace, trainer_args: list[str]) -> tuple[JobSpec, Scheduler[Any], Plan, Path]:
    """The job's spec, scheduler, Plan after the checks before the nodes start (``preflight``: the
    health gate, which may replace hosts) and record directory. Raises UsageError, SpecError."""
    spec, scheduler, plan, job_dir, _ = _plan(args, trainer_args)
    _check_new(job_dir)
    return spec, scheduler, scheduler.preflight(spec, plan, job_dir), job_dir


def prepare(args: argparse.Namespace, trainer_args: list[str]) -> tuple[Scheduler[Any], Plan, JobRecord]:
    """Everything of a submit before the job is handed to its scheduler: the checks, the Plan, the
    checks before the nodes start (``preflight``) and the job record. Raises UsageError, SpecError."""
    spec, scheduler, plan, job_dir = checked(args, trainer_args)
    status = JobStatus(created_at=time.time(), submitter=procs.process_ref())
    try:
        return scheduler, plan, JobRecord.create(job_dir, spec, plan, status)
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(
            f"cannot write the job record in {job_dir} ({e.strerror}): "
            "pass a writable --jobs-root or --job-dir"
        ) from None


def _submit_or_discard(scheduler: Scheduler[Any], plan: Plan, record: JobRecord, *, detach: bool) -> None:
    try:
        scheduler.submit(plan, record, detach=detach)
    except BaseException:  # refused or interrupted before it was accepted: no record of a job never run
        if not record.has_handle():
            record.discard()
        raise


def _console(tee: Tee, plan: Plan, job_dir: Path) -> Callable[[str], bool]:
    """The lines a followed job shows here (``--tee``), said once when some are left out."""
    if not shows_all(tee, plan.nnodes):
        say(
            f"launcher: {plan.nnodes} nodes: the console shows node 0 (rank 0) and every node's warnings "
            f"and errors; every line is in {job_dir}/node-K.log (`launcher logs`; --tee all shows them here)"
        )
    return console_lines(tee, plan.nnodes)


def _submit_detached(scheduler: Scheduler[Any], plan: Plan, record: JobRecord, wait: bool, tee: Tee) -> int:
    """Submit a job that runs on without us; print its id; with ``wait``, follow it to its end (Ctrl-C
    then stops following, not the job)."""
    _submit_or_discard(scheduler, plan, record, detach=True)
    status = scheduler.state(record)
    if status.state.is_terminal:  # it could not start
        return ended(plan.job_id, status)
    print(plan.job_id, flush=True)
    if not wait:
        say(
            f"launcher: job {plan.job_id} submitted to {plan.scheduler} ({status.message or status.state}); "
            f"follow it with `launcher logs -f {plan.job_id}`, wait for it with `launcher wait {plan.job_id}`"
        )
        return EXIT_OK
    say(
        f"launcher: following job {plan.job_id} ({status.message or status.state}); Ctrl-C stops following, "
        f"the job goes on (`launcher cancel {plan.job_id}` stops it)"
    )
    try:
        final = follow(scheduler, record, sys.stdout, keep=_console(tee, plan, record.dir), console=True)
    except KeyboardInterrupt:
        say(f"launcher: stopped following job {plan.job_id}; it goes on")
        return EXIT_INTERRUPTED
    return ended(plan.job_id, final)


class _CancelOnSignal:
    """While attached: Ctrl-C, SIGTERM or SIGHUP (terminal closed) ask the job to stop (the ranks
    checkpoint); a second one stops it at once. A signal that arrives while the job is being started
    is acted on once it has started. A signal ignored by whoever started us (nohup) stays ignored."""

    def __init__(self, scheduler: Scheduler[Any], record: JobRecord) -> None:
        self.scheduler, self.record = scheduler, record
        self.started, self.pending = False, 0

    def __enter__(self) -> _CancelOnSignal:
        watched = [sig for sig in procs.STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
        self.previous = {sig: signal.signal(sig, self._handle) for sig in watched}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        say(
            f"launcher: {signal.Signals(signum).name}: stopping the job (ranks checkpoint, then exit; "
            "again to stop at once)"
        )
        if self.started:
            self.scheduler.cancel(self.record, wait=False)
        else:
            self.pending += 1

    def job_started(self) -> None:
        self.started = True
        for _ in range(self.pending):
            self.scheduler.cancel(self.record, wait=False)
