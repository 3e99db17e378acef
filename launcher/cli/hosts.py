"""The commands on hosts rather than jobs: ``probe`` (this host's versions) and ``check`` (SSH hosts
probed in parallel, their parity, and with ``--collective`` an all_reduce across them)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from pydantic import ValidationError

from gptlaunch.contract import EXIT_OK, EXIT_REFUSED
from launcher.cli.flags import UsageError, argument, flag_name, scheduler_flags, set_flag
from launcher.job.measurements import CollectiveResult
from launcher.job.spec import NetworkSpec
from launcher.preflight.health import COMPUTE_S, Finding, GateSettings, report_text
from launcher.preflight.parity import compare, diff_text, report_table
from launcher.preflight.probe import main as probe_main
from launcher.schedulers.ssh.collective import health_gate
from launcher.schedulers.ssh.hosts import ProbedHosts, hosts_of, probe_job_hosts, route_hosts
from launcher.schedulers.ssh.options import SshOptions


def cmd_probe(args: argparse.Namespace) -> int:
    return probe_main(["--json"] if args.json else [])


def cmd_check(args: argparse.Namespace) -> int:
    """Probe the hosts at once, print the table (or JSON), the diff, and with --collective the
    all_reduce bandwidth and the health gate's findings. Exit 0 when they match and the gate names
    nobody, 3 (EXIT_REFUSED) when they differ or a host is named."""
    opts = _ssh_options(args)
    if not args.collective and (args.min_busbw is not None or args.compute_s != COMPUTE_S):
        raise UsageError("--min-busbw and --compute-s are settings of the health gate: add --collective")
    probed = probe_job_hosts(opts, hosts_of(opts, args.nodes, args.gpus_per_node), args.python)
    mismatches, shortfalls = compare(probed.probes, args.gpus_per_node)
    report: dict[str, object] = {
        "hosts": {h: p.model_dump(mode="json") for h, p in probed.probes.items()},
        "probe_s": probed.probe_s,
        "mismatches": [m.describe() for m in mismatches] + [s.describe() for s in shortfalls],
    }
    if not args.json:
        print(report_table(probed.probes))
        print(f"\n{len(probed.hosts)} host(s) probed in parallel in {probed.probe_s:.1f} s")
        print(
            diff_text(mismatches, shortfalls) if mismatches or shortfalls else "versions match on every host"
        )
    named: list[Finding] = []
    if args.collective and not (mismatches or shortfalls):
        result, found = _check_collective(args, opts, probed)
        named = [f for f in found if f.fatal]
        report["collective"] = result.model_dump(mode="json")
        report["named"] = [asdict(f) for f in named]
        report["warnings"] = [asdict(f) for f in found if not f.fatal]
    if args.json:
        print(json.dumps(report, indent=2))
    return EXIT_REFUSED if mismatches or shortfalls or named else EXIT_OK


# The SSH scheduler's options that `launcher check` takes, with the flags submit has for them.
SSH_CHECK_FIELDS = ("hosts", "hostfile", "ssh_opts", "host_key_check", "connect_timeout_s", "max_parallel")


def _check_collective(
    args: argparse.Namespace, opts: SshOptions, probed: ProbedHosts
) -> tuple[CollectiveResult, list[Finding]]:
    """The routes and rendezvous port an SSH job would get, then the all_reduce across the hosts and
    the health gate's stages (pairs, compute, GPU health); returns the result and every finding
    (the hosts it names, and warnings)."""
    try:
        network = NetworkSpec(
            gloo_socket_ifname=args.gloo_socket_ifname, nccl_socket_ifname=args.nccl_socket_ifname
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    plan = route_hosts(probed, None, args.python)
    env = network.as_env()
    if not args.json:
        forced = env.get("GLOO_SOCKET_IFNAME")
        chosen = ", ".join(f"{h}: {forced or i}" for h, i in plan.ifnames.items())
        print(
            f"\nall_reduce across {len(plan.hosts)} host(s), master_addr "
            f"{plan.master_addr}:{plan.rdzv_port}, interfaces {chosen}"
        )
    gate = GateSettings(
        compute_s=args.compute_s,
        min_busbw=args.min_busbw,
        precision=args.precision,
        gpus_per_node=args.gpus_per_node,
    )
    result, found = health_gate(opts, plan, args.python, env, gate, args.collective_timeout_s)
    if not args.json:
        print(report_text(result, plan.hosts, found))
    return result, found


def add_ssh_flags(parser: argparse.ArgumentParser) -> None:
    """The hosts and how they are reached: the SSH scheduler's flags of ``SSH_CHECK_FIELDS``, made from
    its options as submit's are."""
    for flag in scheduler_flags().values():
        if "ssh" in flag.kinds and flag.field in SSH_CHECK_FIELDS:
            parser.add_argument(flag.flag, **argument(flag))


def _ssh_options(args: argparse.Namespace) -> SshOptions:
    """The SSH scheduler's options from the flags of ``add_ssh_flags`` (defaults for the rest),
    validated as a submit's. Raises UsageError naming the flag and the fix."""
    tree: dict[str, Any] = {"scheduler": {"kind": "ssh"}}
    for flag in scheduler_flags().values():
        if hasattr(args, flag.dest):
            set_flag(tree, flag, getattr(args, flag.dest))
    try:
        return SshOptions.model_validate(tree["scheduler"])
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field = ".".join(str(x) for x in err["loc"] if not isinstance(x, int))
            name = flag_name("ssh", f"scheduler.{field}") if field else None
            lines.append(f"{name}: " * bool(name) + err["msg"].removeprefix("Value error, "))
        raise UsageError("; ".join(lines)) from None
