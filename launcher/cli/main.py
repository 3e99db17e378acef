"""``launcher`` command line: submit, render, list, status, report, logs, wait, cancel, probe, check,
build."""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gptlaunch.contract import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, JOBS_ROOT_ENV
from launcher import __version__
from launcher.cli import build as image_cli
from launcher.cli import hosts, jobs, submit, supervise, sweeps
from launcher.cli.exits import exit_codes_help
from launcher.cli.fields import fields_help
from launcher.cli.flags import UsageError, add_job_flags
from launcher.cli.hints import unknown_arguments
from launcher.cli.hosts import add_ssh_flags
from launcher.cli.sweeps import add_sweep_flags
from launcher.job.console import TEE_ALL_MAX_NODES
from launcher.job.placeholders import help_text as placeholder_help
from launcher.job.record import JobError, JobNotFound, state_help
from launcher.job.spec import SpecError
from launcher.preflight.health import COMPUTE_S, PRECISIONS
from launcher.schedulers.ssh.client import SshError
from launcher.sweep.record import SweepRecord
from launcher.sweep.table import DEFAULT_METRIC

STATES_AND_EXIT_CODES = f"{state_help()}\n\n{exit_codes_help()}"
COMMANDS = "{submit,render,list,status,report,logs,wait,cancel,probe,check,build}"


def _parser(shown: list[str] | None = None) -> argparse.ArgumentParser:
    """``shown``: the schedulers whose own flags and fields ``submit --help`` lists (None: every one)."""
    # Long but flat: one declaration per command and flag, in the order `launcher --help` lists them.
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="launcher",
        description="Launch PyTorch distributed GPT training jobs.",
        epilog=STATES_AND_EXIT_CODES,
        formatter_class=fmt,
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--jobs-root",
        type=Path,
        default=Path(os.environ.get(JOBS_ROOT_ENV, "jobs")),
        help=f"where job records live (default: ${JOBS_ROOT_ENV} or ./jobs)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar=COMMANDS)
    for cmd, text in (
        ("submit", "run a training job: follow it to the end, or --detach"),
        ("render", "print what submit would run (same as submit --dry-run)"),
    ):
        s = sub.add_parser(
            cmd,
            help=text,
            description=f"{text}. After --, your own program in torchrun's forms (SCRIPT.py ARGS, "
            "-m MODULE ARGS or --no-python PROGRAM ARGS), or the built-in trainer's flags (see `trainer "
            "train --help`; without --run-dir there, it is JOB_DIR/run).",
            usage=f"launcher {cmd} [options] [-- SCRIPT.py ARGS... | -- TRAINER_ARGS...]",
            epilog=f"{fields_help(shown)}\n\n{placeholder_help()}\n\n{STATES_AND_EXIT_CODES}",
            formatter_class=fmt,
            allow_abbrev=False,
        )
        add_job_flags(s, shown)
        s.add_argument("--json", action="store_true", help="print the Plan as JSON (render, --dry-run)")
        s.add_argument(
            "--file",
            metavar="NAME",
            help="print only this file of the Plan (render, --dry-run); with --scheduler slurm, "
            "job.sbatch (the default: the standalone script, to sbatch yourself) or submitit.sbatch "
            "(what `launcher submit` hands to sbatch through submitit)",
        )
        if cmd == "submit":
            s.add_argument(
                "--dry-run", action="store_true", help="print the Plan (every node's command) and exit"
            )
            s.add_argument(
                "--detach",
                action="store_true",
                help="print the job id and return once the job started; it runs on after this shell "
                "closes (follow it with `launcher logs -f`, `status`, `wait`, `cancel`). SLURM jobs "
                "always are: submit returns once SLURM accepted the job",
            )
            s.add_argument(
                "--tee",
                choices=["auto", "all", "rank0"],
                default="auto",
                help="which lines of a followed job the console shows: all; rank0 (node 0's and its rank "
                f"0's, and every node's warnings and errors); auto: all up to {TEE_ALL_MAX_NODES} nodes, "
                "rank0 beyond. The node logs keep every line (default: auto)",
            )
            s.add_argument(
                "--wait",
                action="store_true",
                help="follow the job to its end and exit with its exit code (the default, except "
                "for SLURM; Ctrl-C on a SLURM job stops following, not the job)",
            )
            add_sweep_flags(s)
    sub.add_parser("list", help="list jobs and their states")
    for cmd, text in (
        ("status", "show a job's state"),
        (
            "report",
            "write a job's report: one HTML page of charts (loss, attempts, goodput) in its record; "
            "a sweep's: every run's loss, and the runs ranked, in the sweep's directory",
        ),
        ("logs", "print a job's node logs"),
        ("wait", "wait for a job to end; exit with its exit code"),
        ("cancel", "stop a job: ranks checkpoint, then exit"),
    ):
        s = sub.add_parser(
            cmd,
            help=text,
            description=f"{text}.",
            epilog=STATES_AND_EXIT_CODES,
            formatter_class=fmt,
            allow_abbrev=False,
        )
        s.add_argument("job", help="job id (see `launcher list`) or job directory")
        if cmd == "status":
            s.add_argument("--json", action="store_true", help="machine-readable status")
        if cmd == "report":
            s.add_argument(
                "--metric",
                metavar="NAME",
                help="for a sweep only: rank its runs by the lowest NAME each logged in its run dir's "
                f"metrics.jsonl, lower is better (default: {DEFAULT_METRIC})",
            )
        if cmd == "logs":
            s.add_argument("--node", type=int, help="only this node's log")
            s.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    _add_probe_and_check(sub)
    image_cli.add_parser(sub)
    return p


def _add_probe_and_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser(
        "probe",
        help="report this host's versions (Python, torch, CUDA, NCCL, packages, GPUs, interfaces)",
        description="Report what the version-parity check compares: run on every host by `launcher check` "
        "and before every SSH job.",
    )
    s.add_argument("--json", action="store_true", help="one JSON object")
    s = sub.add_parser(
        "check",
        help="probe SSH hosts in parallel and check version parity (and, with --collective, the network)",
        description="Probe every host at once over ssh and print a table; fields that must match (Python, "
        "torch and its git hash, CUDA, NCCL, cuDNN, gptlaunch, key packages, image digest) are "
        "compared and every host needs at least --gpus-per-node GPUs when hosts have GPUs. "
        "--collective also checks master_addr and the rendezvous port, picks each host's interface "
        "and runs a short all_reduce across the hosts, reporting bus bandwidth (nccl-tests' definition); "
        "then the health gate: the same between pairs of hosts in two or three rounds, and a matmul on "
        "every device. Each host it names gets one line that starts with its name.",
        epilog="exit codes:\n"
        "  0    all hosts match (and none is named)\n"
        "  2    invalid input, or a host cannot be reached or checked\n"
        "  3    the hosts differ (the diff is printed), or the health gate named a host (one line each)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_ssh_flags(s)
    s.add_argument("--nodes", type=int, help="check only the first N hosts (default: all)")
    s.add_argument("--gpus-per-node", "--nproc-per-node", type=int, default=1, dest="gpus_per_node",
                   help="GPUs each host must have when hosts have GPUs (default: 1)")  # fmt: skip
    s.add_argument(
        "--python", default=sys.executable, help="the interpreter on the hosts (default: this one)"
    )
    s.add_argument(
        "--collective",
        action="store_true",
        help="also run the network and health checks: an all_reduce across the hosts, then between pairs "
        "of hosts (from 3 hosts: a host whose pairs are both slow is named), a matmul on every device (a "
        "device below 0.8 × the median of its kind is named), and nvidia-smi's GPU health (with GPUs)",
    )
    s.add_argument(
        "--collective-timeout-s", type=float, default=60.0, help="bound on forming the group and on each call"
    )
    s.add_argument(
        "--min-busbw",
        type=_number(above=0.0),
        metavar="GB/s",
        help="with --collective, also name a host whose pairs are all below this bus bandwidth (default: "
        "only below half the median)",
    )
    s.add_argument(
        "--compute-s",
        type=_number(at_least=0.0),
        default=COMPUTE_S,
        help="with --collective, seconds of matmuls per device (0: no compute check; default: %(default)s)",
    )
    s.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="the job's --precision: the dtype of the compute check's matmuls",
    )
    s.add_argument("--gloo-socket-ifname", help="force GLOO_SOCKET_IFNAME (default: chosen per host)")
    s.add_argument("--nccl-socket-ifname", help="force NCCL_SOCKET_IFNAME (default: chosen per host)")
    s.add_argument("--json", action="store_true", help="machine-readable report")


def _number(above: float | None = None, at_least: float | None = None) -> Callable[[str], float]:
    """An argparse type: a float above ``above`` or at least ``at_least``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if (above is not None and value <= above) or (at_least is not None and value < at_least):
            bound = f"above {above:g}" if above is not None else f"at least {at_least:g}"
            raise argparse.ArgumentTypeError(f"{text} must be {bound}")
        return value

    return parse


def allow_many_open_files() -> int:
    """Raise this process's soft limit of open files to its hard limit (no privilege needed) and return
    it: a launch holds a descriptor or two per host (each ssh client's stdin, the fan-out's pipes), and
    the usual soft limit of 1,024 would end a launch of a thousand hosts with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _help_for(argv: list[str]) -> list[str] | None:
    """For ``--help``, the schedulers whose own flags it lists: the one ``--scheduler`` names, or
    none (the common flags, and how to see a scheduler's); None when no help is asked."""
    if "-h" not in argv and "--help" not in argv:
        return None
    for k, arg in enumerate(argv):
        if arg == "--scheduler" and k + 1 < len(argv):
            return [argv[k + 1]]
        if arg.startswith("--scheduler="):
            return [arg.split("=", 1)[1]]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    allow_many_open_files()
    split = argv.index("--") if "--" in argv else len(argv)
    own, trainer_args = argv[:split], argv[split + 1 :]
    if own[:1] == ["supervise"]:  # the controller's own program: not in --help (launcher.cli.supervise)
        return supervise.main(argv[1:])
    parser = _parser(_help_for(own))
    args, extras = parser.parse_known_args(own)
    if extras:  # each with the flag it likely meant, or where it goes
        error = unknown_arguments(parser, args.command, extras)
        print(f"launcher: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if trainer_args and args.command not in ("submit", "render"):
        print(f"launcher: error: `{args.command}` takes no arguments after --", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "submit" and (args.sweep or args.sweep_file):
            return sweeps.cmd_submit_sweep(args, trainer_args, own[own.index("submit") + 1 :])
        if args.command in ("submit", "render"):
            run = submit.cmd_submit if args.command == "submit" else submit.plan_and_print
            return run(args, trainer_args)
        if args.command in ("status", "report", "wait", "cancel") and (
            sweep := SweepRecord.find(args.job, args.jobs_root)
        ):
            if args.command == "status":
                return sweeps.cmd_status(sweep, args.json)
            if args.command == "report":
                return sweeps.cmd_report(sweep, args.metric)
            return sweeps.cmd_wait(sweep) if args.command == "wait" else sweeps.cmd_cancel(sweep)
        if args.command == "report" and args.metric is not None:  # a job has no runs to rank
            raise UsageError(f"--metric ranks a sweep's runs: {args.job} is not a sweep")
        return {
            "list": jobs.cmd_list,
            "status": jobs.cmd_status,
            "report": jobs.cmd_report,
            "logs": jobs.cmd_logs,
            "wait": jobs.cmd_wait,
            "cancel": jobs.cmd_cancel,
            "probe": hosts.cmd_probe,
            "check": hosts.cmd_check,
            "build": image_cli.cmd_build,
        }[args.command](args)
    except (UsageError, JobNotFound, JobError, SpecError, SshError) as e:
        print(f"launcher: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_USAGE)
    except BrokenPipeError:  # `launcher status JOB | head`: the reader had enough
        jobs.silence_stdout()
        return EXIT_OK
    except KeyboardInterrupt:  # Ctrl-C in a command that has no stop of its own (a build, a check)
        print(f"launcher: {args.command} interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
