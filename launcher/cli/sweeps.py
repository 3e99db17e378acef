"""``launcher submit --sweep`` and the commands on a sweep (``list``, ``status``, ``wait``,
``cancel``): every run checked before any starts, one record per sweep, one line or one table for
it. The runs themselves are jobs like any other (``launcher.sweep.drive`` submits them)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gptlaunch.contract import EXIT_OK
from launcher.cli.flags import UsageError, build_spec
from launcher.job.console import say
from launcher.job.plan import Plan
from launcher.job.record import JobRecord, new_job_id
from launcher.job.spec import split_program
from launcher.schedulers import get_scheduler
from launcher.sweep import points as sweep_points
from launcher.sweep.drive import cancel_active, drive
from launcher.sweep.record import (
    Sweep,
    SweepRecord,
    SweepRun,
    counts,
    is_done,
    run_status,
    worst_exit_code,
)
from launcher.sweep.table import DEFAULT_METRIC, SweepFacts, best_val_loss, print_table, run_facts

# ``launcher submit`` flags that are the sweep's, not each run's: (flag, whether it takes a value)
_SWEEP_FLAGS = {
    **{flag: True for flag in ("--sweep", "--sweep-file", "--max-parallel", "--tee", "--job-dir")},
    **{flag: False for flag in ("--yes", "--detach", "--wait", "--dry-run")},
}
# An SSH sweep's checks, done once for all its runs (``_checked_once``).
_SSH_CHECKS = {"--hosts": True, "--hostfile": True, "--skip-parity": False, "--health-check": False,
               "--health-check-warn": False}  # fmt: skip


def add_sweep_flags(parser: argparse.ArgumentParser) -> None:
    """``submit``'s sweep flags, and the hidden ``--job-id`` a sweep's driver names each run with."""
    group = parser.add_argument_group("sweep (many runs from one command)")
    group.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="run once per value (repeatable: every combination). The built-in trainer gets --KEY VALUE; "
        "your program gets VALUE where its arguments say {KEY}",
    )
    group.add_argument(
        "--sweep-file", type=Path, metavar="FILE", help="a YAML list of runs, one mapping of KEY: VALUE each"
    )
    group.add_argument(
        "--max-parallel",
        type=_positive,
        metavar="K",
        help="at most K runs of the sweep at once; the next starts as one ends (default: 1 on one "
        "machine and on SSH hosts, whose runs would share the GPUs; on SLURM as many as it allots)",
    )
    group.add_argument(
        "--yes", action="store_true", help=f"submit a sweep of over {sweep_points.MAX_POINTS:,} runs"
    )
    parser.add_argument("--job-id", help=argparse.SUPPRESS)  # a sweep's run: its id, chosen by the sweep
    parser.add_argument("--sweep-id", help=argparse.SUPPRESS)  # ... and the sweep's (JobSpec.sweep_id)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of runs, 1 or more")
    return int(text)


def cmd_submit_sweep(args: argparse.Namespace, trainer_args: list[str], submit_argv: list[str]) -> int:
    """Check every run, then run the sweep: attached (``drive`` here, Ctrl-C cancels it) or detached
    (a driver process of its own). ``submit_argv``: the arguments given after ``submit``."""
    from launcher.cli.submit import check_trainer_args, plan_and_print  # submit imports this module

    try:
        if args.sweep and args.sweep_file:
            raise sweep_points.SweepError("--sweep and --sweep-file: give the runs one way, not both")
        found = sweep_points.from_file(args.sweep_file) if args.sweep_file else sweep_points.grid(args.sweep)
        sweep_points.check_count(found, args.yes)
        runs = [_run_args(trainer_args, point, k) for k, point in enumerate(found)]
    except sweep_points.SweepError as e:
        raise UsageError(str(e)) from None
    if args.dry_run:
        for k, (point, run_args) in enumerate(zip(found, runs, strict=True)):
            print(f"# run {k}: {sweep_points.describe(point)}")
            plan_and_print(args, run_args)
        return EXIT_OK
    spec = build_spec(args, runs[0])
    scheduler = get_scheduler(spec.scheduler.kind)
    files_here = scheduler.files_here
    for k, run_args in enumerate(runs):  # every run's trainer arguments, before any starts
        try:
            check_trainer_args(build_spec(args, run_args), Path(spec.workdir or Path.cwd()), files_here)
        except UsageError as e:
            raise UsageError(f"run {k} ({sweep_points.describe(found[k])}): {e}") from None
    submit_array = getattr(scheduler, "submit_array", None)  # SLURM: one job array
    max_parallel = _max_parallel(args.max_parallel, spec.scheduler.kind, array=submit_array is not None)
    sweep_id = new_job_id(spec.name)
    directory = (spec.job_dir or args.jobs_root / sweep_id).absolute()
    flags = _without(submit_argv, _SWEEP_FLAGS)  # what every run gets: the flags given, less the sweep's
    if spec.scheduler.kind == "ssh":
        flags = _checked_once(args, runs[0], flags)
    submit = ["--jobs-root", str(directory), "submit", "--detach"]  # each run, into the sweep's directory
    entries: list[SweepRun] = []
    for k, (point, run_args) in enumerate(zip(found, runs, strict=True)):
        job_id = f"{sweep_id}-{k}"
        argv = [*submit, "--job-id", job_id, "--sweep-id", sweep_id, *flags, "--", *run_args]
        entries.append(SweepRun(index=k, values=point, job_id=job_id, argv=argv))
    sweep = Sweep(
        sweep_id=sweep_id,
        created_at=time.time(),
        scheduler=spec.scheduler.kind,
        max_parallel=max_parallel,
        runs=entries,
    )
    try:
        record = SweepRecord.create(directory, sweep)
    except OSError as e:  # FileExistsError: the directory is not empty
        raise UsageError(f"cannot write the sweep's record in {directory}: {e}") from None
    at_once = f"at most {max_parallel} at once" if max_parallel else "as many at once as SLURM allots"
    say(
        f"launcher: sweep {sweep_id}: {len(entries)} runs on {sweep.scheduler}, {at_once}; record {directory}"
    )
    if submit_array is not None:
        return _as_array(args, record, runs, submit_array)
    return _detach(record, sweep_id, args.wait) if args.detach else _attached(record)


def _as_array(
    args: argparse.Namespace, record: SweepRecord, runs: list[list[str]], submit_array: Callable[..., object]
) -> int:
    """Every run's job record made as a submit makes it, then all submitted as one array (the
    scheduler's ``submit_array``); nothing is left of the sweep when the scheduler refuses it.
    Returns once the scheduler accepted the array (``--wait``: once every run ended)."""
    from launcher.cli.submit import prepare

    sweep = record.load()
    prepared: list[tuple[Plan, JobRecord]] = []
    try:
        for run, run_args in zip(sweep.runs, runs, strict=True):
            own = {"jobs_root": record.dir, "job_id": run.job_id, "job_dir": None, "sweep_id": sweep.sweep_id}
            # The first run's notes on the cluster (its partition, GPUs) are every run's: said once.
            quiet = contextlib.redirect_stderr(io.StringIO()) if prepared else contextlib.nullcontext()
            with quiet:
                _, plan, job = prepare(argparse.Namespace(**(vars(args) | own)), run_args)
            prepared.append((plan, job))
        submit_array(prepared, record.dir / "submitit", sweep.max_parallel)
    except BaseException:
        shutil.rmtree(record.dir, ignore_errors=True)  # no job of it was accepted
        raise
    for run in sweep.runs:
        run.submitted_at = time.time()
    record.save(sweep)
    print(sweep.sweep_id, flush=True)
    say(f"launcher: sweep {sweep.sweep_id}: one job array: `launcher status|wait|cancel {sweep.sweep_id}`")
    return cmd_wait(record) if args.wait else EXIT_OK


def _max_parallel(given: int | None, kind: str, *, array: bool) -> int | None:
    """Runs at once: ``given``, else all for a scheduler that allots each run its own nodes (SLURM's
    array; None), else 1: the runs of one machine share its GPUs. Raises UsageError for more than one
    on SSH hosts, where every run takes the hostfile's first hosts: runs at once would share them."""
    if kind == "ssh" and (given or 1) > 1:
        raise UsageError(
            f"--max-parallel {given} on SSH hosts: every run takes the hostfile's first hosts, so runs "
            "at once would share them; give --max-parallel 1 (or one sweep per hostfile)"
        )
    return given or (None if array else 1)


def _run_args(trainer_args: list[str], point: sweep_points.Point, k: int) -> list[str]:
    """The arguments after ``--`` of the ``k``-th run, at ``point``. Raises SweepError."""
    from trainer.precheck import train_flags  # its parser: no torch

    if split_program(trainer_args)[0] is not None:
        return sweep_points.program_args(trainer_args, point)
    return sweep_points.run_dir_args(sweep_points.trainer_args(trainer_args, point, train_flags()), k)


def _without(flags: list[str], dropped: dict[str, bool]) -> list[str]:
    """``flags`` less those named in ``dropped`` (flag -> whether it takes a value), in either form."""
    out, skip = [], False
    for arg in flags:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in dropped:
            skip = dropped[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def _checked_once(args: argparse.Namespace, run_args: list[str], flags: list[str]) -> list[str]:
    """SSH hosts: version parity and the health gate once for the whole sweep, as the first run's
    submit would run them; every run then gets the hosts in the order they left them (a host the gate
    named left out, its spare in its place) and checks neither again. Returns the runs' flags.
    Raises what a submit's checks raise (HostsRefused: exit 3)."""
    from launcher.cli.submit import checked
    from launcher.schedulers.ssh.hosts import hosts_of
    from launcher.schedulers.ssh.options import SshOptions

    spec, _, plan, _ = checked(args, run_args)
    opts = spec.options(SshOptions)
    running = [n.host for n in plan.nodes]
    named = [h for h in hosts_of(opts, spec.nnodes) if h not in running]
    order = running + [h for h in hosts_of(opts) if h not in running and h not in named]
    say(f"launcher: the sweep's hosts passed parity{' and the health gate' if opts.gate else ''}: "
        f"its runs check them no more")  # fmt: skip
    return [*_without(flags, _SSH_CHECKS), "--hosts", ",".join(order), "--skip-parity"]


def _detach(record: SweepRecord, sweep_id: str, wait: bool) -> int:
    """Start the sweep's driver as a process of its own, which outlives this shell (``wait``: then
    wait here for the sweep to end, and exit with its worst run's code)."""
    with (record.dir / "driver.log").open("w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "launcher.sweep.drive", str(record.dir)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    record.driver_is(driver.pid)
    print(sweep_id, flush=True)
    say(f"launcher: sweep {sweep_id} runs on in the background: `launcher status|wait|cancel {sweep_id}`")
    return cmd_wait(record) if wait else EXIT_OK


def _attached(record: SweepRecord) -> int:
    """Drive the sweep here to its end; Ctrl-C cancels it: no run starts any more, and those running
    checkpoint and stop. Prints the sweep's table; returns its worst run's exit code."""
    record.driver_is(os.getpid())
    try:
        drive(record)
    except KeyboardInterrupt:
        say("launcher: cancelling the sweep: the running runs checkpoint and stop")
        record.request_cancel()
        cancel_active(record, record.load().runs)
    print_table(record)
    return worst_exit_code([run_status(record, run) for run in record.load().runs])


# --------------------------------------------------------------------------- commands on a sweep


def cmd_status(record: SweepRecord, as_json: bool) -> int:
    """The sweep's runs as a table (or JSON): values, state, last step, best val loss, goodput."""
    if as_json:
        found = [
            {
                "run": run.index, "values": run.values, "state": run.state, "step": run.step,
                "best_val_loss": best_val_loss(run),
                "goodput": run.goodput, "job_id": run.job_id, "error": run.error,
            }
            for run in run_facts(record, time.time())
        ]  # fmt: skip
        print(json.dumps(found, indent=2))
    else:
        print_table(record)
    return EXIT_OK


def cmd_wait(record: SweepRecord) -> int:
    """Wait for every run to end; exit with the worst run's code."""
    while not is_done(statuses := [run_status(record, run) for run in record.load().runs]):
        # Each running run's state is a read of its record (SLURM: of sacct, at most every few
        # seconds per job): a large sweep is read less often.
        time.sleep(min(30.0, 1.0 + 0.1 * sum(s is not None and not s.state.is_terminal for _, s in statuses)))
    say(f"launcher: sweep {record.load().sweep_id}: {counts([state for state, _ in statuses])}")
    return worst_exit_code(statuses)


def cmd_cancel(record: SweepRecord) -> int:
    """No run starts any more; those running checkpoint and stop (as `cancel JOB`)."""
    record.request_cancel()
    sweep = record.load()
    cancel_active(record, sweep.runs)
    print(f"sweep {sweep.sweep_id}: cancelled ({counts([run_status(record, r)[0] for r in sweep.runs])})")
    return EXIT_OK


def cmd_report(record: SweepRecord, metric: str | None) -> int:
    """Write the sweep's report page into its directory and print its path: every run's loss, and
    the runs ranked by ``metric`` (None: val_loss)."""
    from launcher.report.page import render_sweep, write  # plotly: only this command pays its import

    now = time.time()
    sweep, runs = record.load(), run_facts(record, now)
    facts = SweepFacts(sweep.sweep_id, sweep.scheduler, counts([r.state for r in runs]), runs, now)
    print(write(record.dir, render_sweep(facts, metric or DEFAULT_METRIC)))
    return EXIT_OK
