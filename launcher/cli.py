"""``launcher`` command line: submit, render, list, status, logs, cancel.

Exit codes: 0 success, 1 job failed, 2 invalid input (nothing written), 75 the job stopped on request
after its ranks saved a checkpoint (submit again with the same --run-dir to resume), 130 stopped on
request with no checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from launcher import __version__
from launcher.jobs import JobNotFound, JobRecord, list_jobs, new_job_id, shown_state
from launcher.plan import Plan
from launcher.schedulers import SCHEDULERS, get_scheduler
from launcher.spec import JobSpec, SpecError, check_text, describe_fields

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_CODES = (
    "exit codes: 0 success; 1 job failed (the failing node, rank and error are printed); "
    "2 invalid input (nothing is written); 75 stopped on request after a checkpoint "
    "(submit again with the same --run-dir to resume); 130 stopped on request, no checkpoint"
)

# Flag -> dotted JobSpec field. Only flags given on the command line override the config file.
FLAG_FIELDS = {
    "name": "name",
    "scheduler": "scheduler",
    "nodes": "nnodes",
    "gpus_per_node": "nproc_per_node",
    "job_dir": "job_dir",
    "workdir": "workdir",
    "python": "python",
    "omp_num_threads": "omp_num_threads",
    "grace_period_s": "grace_period_s",
    "rdzv_backend": "rendezvous.backend",
    "rdzv_endpoint": "rendezvous.endpoint",
    "rdzv_port": "rendezvous.port",
    "rdzv_id": "rendezvous.id",
    "rdzv_join_timeout_s": "rendezvous.join_timeout_s",
    "rdzv_last_call_timeout_s": "rendezvous.last_call_timeout_s",
    "max_restarts": "rendezvous.max_restarts",
    "nccl_socket_ifname": "network.nccl_socket_ifname",
    "gloo_socket_ifname": "network.gloo_socket_ifname",
    "nccl_ib_disable": "network.nccl_ib_disable",
    "nccl_debug": "network.nccl_debug",
}
FIELD_FLAGS = {field: "--" + flag.replace("_", "-") for flag, field in FLAG_FIELDS.items()}


class UsageError(Exception):
    """Bad input; the message names the field and the fix."""


def _job_flags(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    p.add_argument("--config", type=Path, help="job config file (YAML; fields below); flags override it")
    p.add_argument("--scheduler", default=S, help=f"where to run: {', '.join(SCHEDULERS)} (default: local)")
    p.add_argument("--nodes", type=int, default=S, help="number of nodes, nnodes (default: 1)")
    p.add_argument(
        "--gpus-per-node",
        "--nproc-per-node",
        dest="gpus_per_node",
        type=int,
        default=S,
        help="processes per node, nproc_per_node: one per GPU; on a machine without GPUs, the "
        "number of CPU processes per node (default: 1)",
    )
    p.add_argument("--name", default=S, help="job name, prefix of the job id (default: gpt)")
    p.add_argument("--job-dir", type=Path, default=S, help="job record directory (default: JOBS_ROOT/JOB_ID)")
    p.add_argument("--workdir", type=Path, default=S, help="working directory of the processes (default: .)")
    p.add_argument("--python", default=S, help="Python interpreter on the nodes (default: this one)")
    p.add_argument(
        "--omp-num-threads",
        type=int,
        default=S,
        help="OMP_NUM_THREADS per process (default local: cores / world_size)",
    )
    p.add_argument(
        "--grace-period-s",
        type=float,
        default=S,
        help="seconds from SIGTERM (ranks checkpoint) to SIGKILL on cancel (default: 45)",
    )
    r = p.add_argument_group("rendezvous")
    r.add_argument("--rdzv-backend", choices=["c10d", "static"], default=S, help="(default: c10d)")
    r.add_argument("--rdzv-endpoint", default=S, help="rendezvous host (default: the first node)")
    r.add_argument("--rdzv-port", type=int, default=S, help="rendezvous port (default: free port when local)")
    r.add_argument("--rdzv-id", default=S, help="rendezvous id (default: the job id)")
    r.add_argument("--rdzv-join-timeout-s", type=int, default=S, help="seconds for all nodes to join (600)")
    r.add_argument("--rdzv-last-call-timeout-s", type=int, default=S, help="seconds for late joiners (30)")
    r.add_argument("--max-restarts", type=int, default=S, help="torchrun worker-group restarts (default: 0)")
    n = p.add_argument_group("network (environment of every node)")
    n.add_argument("--nccl-socket-ifname", default=S, help="NCCL_SOCKET_IFNAME, e.g. eth0 or ^lo,docker")
    n.add_argument("--gloo-socket-ifname", default=S, help="GLOO_SOCKET_IFNAME, e.g. eth0")
    n.add_argument(
        "--nccl-ib-disable",
        action=argparse.BooleanOptionalAction,
        default=S,
        help="NCCL_IB_DISABLE=1/0 (TCP sockets instead of InfiniBand)",
    )
    n.add_argument("--nccl-debug", choices=["VERSION", "WARN", "INFO", "TRACE"], default=S, help="NCCL_DEBUG")
    n.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment variable for every process (repeatable)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the Plan (every node's command) and exit")
    p.add_argument("--json", action="store_true", help="with --dry-run: the Plan as JSON")


def _fields_help() -> str:
    rows = [f"  {name:34} {desc}" for name, desc, _ in describe_fields()]
    return "config file fields (YAML; nested as rendezvous: {port: 29500}):\n" + "\n".join(rows)


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="launcher",
        description="Launch PyTorch distributed GPT training jobs.",
        epilog=EXIT_CODES,
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--jobs-root",
        type=Path,
        default=Path(os.environ.get("GPTLAUNCH_JOBS_ROOT", "jobs")),
        help="where job records live (default: $GPTLAUNCH_JOBS_ROOT or ./jobs)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{submit,render,list,status,logs,cancel}")
    usage = "launcher %(cmd)s [options] [-- TRAINER_ARGS...]"
    for cmd, text in (
        ("submit", "run a training job and follow it to the end"),
        ("render", "print what submit would run (same as submit --dry-run)"),
    ):
        s = sub.add_parser(
            cmd,
            help=text,
            description=f"{text}. Arguments after -- go to `trainer train` "
            "(see `trainer train --help`); without --run-dir there, it is JOB_DIR/run.",
            usage=usage % {"cmd": cmd},
            epilog=f"{_fields_help()}\n\n{EXIT_CODES}",
            formatter_class=fmt,
            allow_abbrev=False,
        )
        _job_flags(s)
    sub.add_parser("list", help="list jobs")
    for cmd, text in (
        ("status", "show a job's state"),
        ("logs", "print a job's node logs"),
        ("cancel", "stop a job: ranks checkpoint, then exit"),
    ):
        s = sub.add_parser(cmd, help=text, allow_abbrev=False)
        s.add_argument("job", help="job id (see `launcher list`) or job directory")
        if cmd == "status":
            s.add_argument("--json", action="store_true", help="machine-readable status")
        if cmd == "logs":
            s.add_argument("--node", type=int, help="only this node's log")
            s.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    return p


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise UsageError(f"{key} in --config must be a mapping of fields (see `launcher submit --help`)")
    tree[leaf] = value


def _load_config(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror}; check the path") from None
    except UnicodeDecodeError:
        raise UsageError(f"--config {path} is not UTF-8 text: save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path} must hold a mapping of job fields (see `launcher submit --help`)")
    return data


def build_spec(args: argparse.Namespace, trainer_args: list[str]) -> JobSpec:
    """Config file, then flags, then trainer arguments -> validated JobSpec. Raises UsageError."""
    tree = _load_config(args.config) if args.config else {}
    for flag, field in FLAG_FIELDS.items():
        if hasattr(args, flag):
            _set(tree, field, getattr(args, flag))
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--env {item!r}: use KEY=VALUE")
        _set(tree, f"network.env.{key}", value)
    if trainer_args:
        from_file = tree.get("trainer_args", [])
        if not isinstance(from_file, list):
            raise UsageError("trainer_args in --config must be a list of strings, e.g. [--max-steps, '100']")
        tree["trainer_args"] = [*from_file, *trainer_args]
    try:
        return JobSpec.model_validate(tree)
    except ValidationError as e:
        raise UsageError(_describe(e, args.config)) from None


def _describe(e: ValidationError, config: Path | None) -> str:
    lines = ["invalid job spec:"]
    for err in e.errors():
        field = ".".join(str(x) for x in err["loc"] if not isinstance(x, int))
        flag = FIELD_FLAGS.get(field)
        where = f"{field} ({flag})" if flag else field or "job spec"
        got = (
            f" (got {err['input']!r})"
            if err["type"] != "missing" and not isinstance(err["input"], dict)
            else ""
        )
        hint = "; remove it or check the spelling" if err["type"] == "extra_forbidden" else ""
        lines.append(f"  {where}: {err['msg']}{got}{hint}")
    if config:
        lines.append(f"  (fields from --config {config} or the flags; see `launcher submit --help`)")
    return "\n".join(lines)


def check_trainer_args(spec: JobSpec) -> None:
    """Validate the trainer's arguments before anything is written or started: flags, values, data
    files, and that the global batch splits over this job's world_size. Raises UsageError."""
    from trainer.cli import UsageError as TrainerUsage
    from trainer.data import DataError

    try:
        # Relative paths among them are the trainer's, resolved in its working directory.
        with contextlib.chdir(spec.workdir):
            _check_trainer_args(spec)
    except (TrainerUsage, DataError, ValueError) as e:
        raise UsageError(f"trainer arguments: {e}") from None
    except SystemExit as e:
        if e.code == 0:  # `-- --help` printed the trainer's help
            raise
        # argparse already printed which flag it did not know
        raise UsageError("trainer arguments are not valid (see above and `trainer train --help`)") from e


def _check_trainer_args(spec: JobSpec) -> None:
    from trainer.cli import parse_train_args
    from trainer.data import DataSource, check_source

    cfg = parse_train_args(spec.trainer_args)
    cfg.grad_accum_steps(spec.world_size)
    cfg.check_resume_path()
    source = DataSource(cfg.dataset, cfg.dataset_config, tuple(cfg.text_files))
    check_source(source, vocab_size=cfg.vocab_size, token_dtype=cfg.token_dtype)


def _plan(args: argparse.Namespace, trainer_args: list[str]) -> tuple[JobSpec, Plan, Path]:
    try:
        check_text(str(args.jobs_root), "--jobs-root")
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec = build_spec(args, trainer_args)
    scheduler = get_scheduler(spec.scheduler)
    spec = scheduler.resolve(spec)
    check_trainer_args(spec)
    job_id = new_job_id(spec.name)
    job_dir = (spec.job_dir or args.jobs_root / job_id).absolute()
    return spec, scheduler.render(spec, job_id, job_dir), job_dir


def cmd_submit(args: argparse.Namespace, trainer_args: list[str]) -> int:
    spec, plan, job_dir = _plan(args, trainer_args)
    if args.dry_run or args.command == "render":
        print(plan.to_json() if args.json else plan.to_text().rstrip("\n"))
        return EXIT_OK
    try:
        record = JobRecord.create(job_dir, spec, plan)
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    print(
        f"launcher: job {plan.job_id}: {plan.nnodes} node(s) × {plan.nproc_per_node} process(es) on "
        f"{plan.scheduler}; record {job_dir}; run dir {plan.run_dir}",
        flush=True,
    )
    status = get_scheduler(spec.scheduler).launch(plan, record)
    took = (status.ended_at or time.time()) - status.started_at
    detail = f": {status.message}" if status.message else ""
    summary = f"launcher: job {plan.job_id} {status.state} after {took:.1f} s{detail}"
    with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP); the record has it all
        print(summary, file=sys.stderr, flush=True)
    return status.exit_code if status.exit_code is not None else EXIT_FAILED


def cmd_list(args: argparse.Namespace) -> int:
    print(f"{'JOB ID':40} {'STATE':13} {'NODES':>5} {'PROCS':>5} {'STARTED (UTC)':20} {'SECONDS':>8}")
    for rec in list_jobs(args.jobs_root):
        plan, st = rec.plan(), rec.status()
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(st.started_at)) if st else "-"
        secs = f"{(st.ended_at or time.time()) - st.started_at:.0f}" if st else "-"
        print(
            f"{plan.job_id:40} {shown_state(st):13} {plan.nnodes:>5} "
            f"{plan.nproc_per_node:>5} {started:20} {secs:>8}"
        )
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    rec = JobRecord.open(args.job, args.jobs_root)
    st, plan = rec.status(), rec.plan()
    if args.json:
        print(
            json.dumps(
                {**(st.model_dump(mode="json") if st else {}), "shown_state": shown_state(st)}, indent=2
            )
        )
        return EXIT_OK
    print(f"job {plan.job_id}: {shown_state(st)}")
    print(f"  scheduler {plan.scheduler}, {plan.nnodes} node(s) × {plan.nproc_per_node}, record {rec.dir}")
    print(f"  run dir {plan.run_dir}")
    if st and st.exit_code is not None:
        print(f"  exit code {st.exit_code}: {st.message or st.state}")
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    from launcher.logs import LogFollower

    rec = JobRecord.open(args.job, args.jobs_root)
    nodes = [n for n in rec.plan().nodes if args.node is None or n.node_rank == args.node]
    if not nodes:
        raise UsageError(f"--node {args.node}: the job has nodes 0..{rec.plan().nnodes - 1}")
    follower = LogFollower([(f"node{n.node_rank}", rec.dir / n.log) for n in nodes], sys.stdout)
    follower.start()
    while args.follow and shown_state(rec.status()) == "running":
        time.sleep(0.5)
    follower.stop()
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    rec = JobRecord.open(args.job, args.jobs_root)
    spec = rec.spec()
    status = get_scheduler(spec.scheduler).cancel(rec)
    print(f"job {rec.job_id}: {status.state}" + (f" ({status.message})" if status.message else ""))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, trainer_args = argv[:split], argv[split + 1 :]
    args = _parser().parse_args(own)
    if trainer_args and args.command not in ("submit", "render"):
        print(f"launcher: error: `{args.command}` takes no arguments after --", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command in ("submit", "render"):
            return cmd_submit(args, trainer_args)
        return {"list": cmd_list, "status": cmd_status, "logs": cmd_logs, "cancel": cmd_cancel}[args.command](
            args
        )
    except (UsageError, JobNotFound, SpecError) as e:
        print(f"launcher: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
