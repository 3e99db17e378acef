"""The ``launcher`` commands. Each takes the parsed arguments and returns the exit code; user mistakes
raise UsageError (exit 2, nothing written).

Only ``submit`` and ``render`` read the trainer's arguments; ``list``, ``status``, ``logs``, ``cancel``
and ``wait`` read the job record and ask its scheduler, importing no torch: they answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from launcher.cli.flags import UsageError, build_spec
from launcher.job.plan import Plan
from launcher.job.record import JobError, JobRecord, JobStatus, list_jobs, new_job_id
from launcher.job.spec import JobSpec, check_text
from launcher.schedulers import get_scheduler
from launcher.schedulers.base import Scheduler
from launcher.supervisor import procs
from trainer.contract import EXIT_INTERRUPTED, EXIT_OK, EXIT_PARITY


def check_trainer_args(spec: JobSpec, workdir: Path, files_here: bool) -> None:
    """Validate the trainer's arguments before anything is written or started: flags, values, that the
    global batch splits over this job's world_size and, when the nodes see this machine's files
    (``files_here``), the data files and resume checkpoint. Raises UsageError."""
    from trainer.precheck import InvalidTrainerArgs, check_train_args

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


def _plan(args: argparse.Namespace, trainer_args: list[str]) -> tuple[JobSpec, Scheduler[Any], Plan, Path]:
    try:
        check_text(str(args.jobs_root), "--jobs-root")
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec = build_spec(args, trainer_args)
    scheduler = get_scheduler(spec.scheduler.kind)
    facts = scheduler.resolve(spec)
    check_trainer_args(spec, Path(facts.workdir), scheduler.files_here)
    job_id = new_job_id(spec.name)
    job_dir = (spec.job_dir or args.jobs_root / job_id).absolute()
    return spec, scheduler, scheduler.render(spec, facts, job_id, job_dir), job_dir


def cmd_render(args: argparse.Namespace, trainer_args: list[str]) -> int:
    _, _, plan, _ = _plan(args, trainer_args)
    print(plan.to_json() if args.json else plan.to_text().rstrip("\n"))
    return EXIT_OK


def cmd_submit(args: argparse.Namespace, trainer_args: list[str]) -> int:
    if args.dry_run:
        return cmd_render(args, trainer_args)
    if args.detach and args.wait:
        raise UsageError("--detach and --wait contradict each other: keep one")
    spec, scheduler, plan, job_dir = _plan(args, trainer_args)
    scheduler.preflight(spec, plan)
    status = JobStatus(created_at=time.time(), submitter=procs.process_ref())
    try:
        record = JobRecord.create(job_dir, spec, plan, status)
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(
            f"cannot write the job record in {job_dir} ({e.strerror}): "
            "pass a writable --jobs-root or --job-dir"
        ) from None
    if args.detach or scheduler.queued:
        return _submit_detached(scheduler, plan, record, wait=args.wait)
    _say(
        f"launcher: job {plan.job_id}: {plan.nnodes} node(s) × {plan.nproc_per_node} process(es) on "
        f"{plan.scheduler}; record {job_dir}; run dir {plan.run_dir}"
    )
    with _CancelOnSignal(scheduler, record) as stopper:
        _submit_or_discard(scheduler, plan, record, detach=False)
        stopper.job_started()
        final = follow(scheduler, record, sys.stdout, attached=True)
    _say(_summary(plan.job_id, final))
    return final.job_exit_code


def _submit_or_discard(scheduler: Scheduler[Any], plan: Plan, record: JobRecord, *, detach: bool) -> None:
    try:
        scheduler.submit(plan, record, detach=detach)
    except BaseException:  # refused or interrupted before it was accepted: no record of a job never run
        if not record.has_handle():
            record.discard()
        raise


def _submit_detached(scheduler: Scheduler[Any], plan: Plan, record: JobRecord, wait: bool) -> int:
    """Submit a job that runs on without us; print its id; with ``wait``, follow it to its end (Ctrl-C
    then stops following, not the job)."""
    _submit_or_discard(scheduler, plan, record, detach=True)
    status = scheduler.state(record)
    if status.state.is_terminal:  # it could not start
        _say(_summary(plan.job_id, status))
        return status.job_exit_code
    print(plan.job_id, flush=True)
    if not wait:
        _say(
            f"launcher: job {plan.job_id} submitted to {plan.scheduler} ({status.message or status.state}); "
            f"follow it with `launcher logs -f {plan.job_id}`, wait for it with `launcher wait {plan.job_id}`"
        )
        return EXIT_OK
    _say(
        f"launcher: following job {plan.job_id} ({status.message or status.state}); Ctrl-C stops following, "
        f"the job goes on (`launcher cancel {plan.job_id}` stops it)"
    )
    try:
        final = follow(scheduler, record, sys.stdout)
    except KeyboardInterrupt:
        _say(f"launcher: stopped following job {plan.job_id}; it goes on")
        return EXIT_INTERRUPTED
    _say(_summary(plan.job_id, final))
    return final.job_exit_code


def follow(
    scheduler: Scheduler[Any],
    record: JobRecord,
    out: TextIO | None,
    node: int | None = None,
    attached: bool = False,
) -> JobStatus:
    """The one follow loop (attached submit, ``logs --follow``, ``wait``): copy the job's node-prefixed
    output to ``out`` (None: discard it) until the job reaches a terminal state; return that status.
    If ``out`` closes (``| head``, a closed terminal), an ``attached`` submit follows on quietly (it
    owns the job), anything else stops following and returns the status then."""
    _copy(scheduler.logs(record, node, follow=True), out, attached)
    return scheduler.state(record)


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
            _silence_stdout()
            if not keep_reading:
                return


def _silence_stdout() -> None:
    """After stdout broke, point it at /dev/null so that Python's exit-time flush stays quiet."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


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
        _say(
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


def _say(text: str) -> None:
    with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP); the record has it all
        print(text, file=sys.stderr, flush=True)


def _summary(job_id: str, status: JobStatus) -> str:
    took = (status.ended_at or time.time()) - (status.started_at or status.created_at)
    detail = f": {status.message}" if status.message else ""
    return f"launcher: job {job_id} {status.state} after {took:.1f} s{detail}"


def _open(args: argparse.Namespace) -> tuple[JobRecord, Scheduler[Any]]:
    record = JobRecord.open(args.job, args.jobs_root)
    return record, _scheduler_of(record)


def _scheduler_of(record: JobRecord) -> Scheduler[Any]:
    name = record.plan().scheduler
    try:
        return get_scheduler(name)
    except KeyError:
        raise JobError(
            f"{record.dir} was submitted to scheduler {name!r}, which this launcher lacks"
        ) from None


def cmd_list(args: argparse.Namespace) -> int:
    print(f"{'JOB ID':40} {'STATE':13} {'NODES':>5} {'PROCS':>5} {'CREATED (UTC)':20} {'SECONDS':>8}")
    for record in list_jobs(args.jobs_root):
        try:
            plan = record.plan()
            st = _scheduler_of(record).state(record)
        except (OSError, ValueError, JobError) as e:  # ValidationError is a ValueError
            _say(f"launcher: skipping {record.dir}: unreadable job record ({type(e).__name__}): {e}")
            continue
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(st.created_at))
        secs = f"{(st.ended_at or time.time()) - st.started_at:.0f}" if st.started_at else "-"
        print(
            f"{plan.job_id:40} {st.state:13} {plan.nnodes:>5} {plan.nproc_per_node:>5} {created:20} {secs:>8}"
        )
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    record, scheduler = _open(args)
    st, plan = scheduler.state(record), record.plan()
    if args.json:
        print(json.dumps(st.model_dump(mode="json"), indent=2))
        return EXIT_OK
    print(f"job {plan.job_id}: {st.state}")
    print(f"  scheduler {plan.scheduler}, {plan.nnodes} node(s) × {plan.nproc_per_node}, record {record.dir}")
    print(f"  run dir {plan.run_dir}")
    if st.state.is_terminal:
        print(f"  exit code {st.job_exit_code}: {st.message or st.state}")
    elif st.message:
        print(f"  {st.message}")
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
    final = follow(scheduler, record, None)
    _say(_summary(record.job_id, final))
    return final.job_exit_code


def cmd_cancel(args: argparse.Namespace) -> int:
    record, scheduler = _open(args)
    status = scheduler.cancel(record)
    print(f"job {record.job_id}: {status.state}" + (f" ({status.message})" if status.message else ""))
    return EXIT_OK


def cmd_probe(args: argparse.Namespace) -> int:
    from launcher.preflight.probe import main as probe_main

    return probe_main(["--json"] if args.json else [])


def cmd_check(args: argparse.Namespace) -> int:
    """Probe the hosts at once, print the table (or JSON), the diff, and with --collective the
    all_reduce bandwidth. Exit 0 when they match, 3 (EXIT_PARITY) when not."""
    from launcher.preflight.parity import compare, diff_text, report_table
    from launcher.schedulers.ssh import hosts as check
    from launcher.schedulers.ssh.options import SshOptions

    try:
        opts = SshOptions(
            hosts=[h.strip() for h in args.hosts.split(",") if h.strip()] if args.hosts else [],
            hostfile=args.hostfile,
            ssh_opts=args.ssh_opt,
            host_key_check=args.ssh_host_key_check,
            connect_timeout_s=args.ssh_connect_timeout_s,
        )
    except ValueError as e:  # pydantic's ValidationError is one
        raise UsageError(str(e)) from None
    settings = check.ssh_settings(opts)
    hosts = check.hosts_of(opts, args.nodes, args.gpus_per_node)
    master = check.master_address(settings, hosts[0])
    started = time.monotonic()
    probes = check.probe_hosts(settings, hosts, args.python, master)
    probe_s = time.monotonic() - started
    mismatches, shortfalls = compare(probes, args.gpus_per_node)
    report: dict[str, object] = {
        "hosts": {h: p.model_dump(mode="json") for h, p in probes.items()},
        "probe_s": probe_s,
        "mismatches": [m.describe() for m in mismatches] + [s.describe() for s in shortfalls],
    }
    if not args.json:
        print(report_table(probes))
        print(f"\n{len(hosts)} host(s) probed in parallel in {probe_s:.1f} s")
        print(
            diff_text(mismatches, shortfalls) if mismatches or shortfalls else "versions match on every host"
        )
    if args.collective and not (mismatches or shortfalls):
        report["collective"] = _check_collective(args, opts, probes, master).model_dump(mode="json")
    if args.json:
        print(json.dumps(report, indent=2))
    return EXIT_PARITY if mismatches or shortfalls else EXIT_OK


def _check_collective(args: argparse.Namespace, opts: Any, probes: dict[str, Any], master: str) -> Any:
    from launcher.preflight.collective import format_table
    from launcher.schedulers.ssh import hosts as check

    hosts = list(probes)
    settings = check.ssh_settings(opts)
    ifnames = check.choose_ifnames(probes, master, multi_host=len(hosts) > 1)
    port = probes[hosts[0]].free_port
    check.check_port(settings, hosts, args.python, master, port)
    env = {
        k: v
        for k, v in (
            ("GLOO_SOCKET_IFNAME", args.gloo_socket_ifname),
            ("NCCL_SOCKET_IFNAME", args.nccl_socket_ifname),
        )
        if v
    }
    plan = check.HostPlan(hosts, master, port, ifnames, probes)
    if not args.json:
        chosen = ", ".join(f"{h}: {env.get('GLOO_SOCKET_IFNAME', i)}" for h, i in ifnames.items())
        print(f"\nall_reduce across {len(hosts)} host(s), master_addr {master}:{port}, interfaces {chosen}")
    result = check.collective(opts, plan, args.python, env, args.collective_timeout_s)
    if not args.json:
        print(format_table(result))
    return result
