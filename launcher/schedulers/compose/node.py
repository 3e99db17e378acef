"""The entry point of a compose node's container: ``python -m launcher.schedulers.compose.node
--job-dir D --node K --nodes N [--gpus-per-node G] [--skip-parity] -- TORCHRUN_ARGV...``.

The secrets come from stdin. Then version parity: this container's probe goes to
``D/parity/node-K.json``; once every node's report is there (at most PEERS_TIMEOUT_S), they are compared
(``launcher.preflight.parity_step.check``, the SLURM step's comparison): on a mismatch the node exits 3
with the diff before any rank starts and sends a ``launcher.job.reports.Refused`` report. Then the node
agent (``launcher.agent.node``) runs torchrun, as the container's init.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from gptlaunch.contract import EXIT_FAILED
from gptlaunch.files import atomic_write_text
from launcher.agent.node import NodeAgent
from launcher.job import reports
from launcher.job.hang import add_watch_flags, heartbeat_dir, parse_with_command, watch_of
from launcher.preflight.parity_step import PROBE_DIR, check, end_step
from launcher.preflight.probe import collect
from launcher.supervisor.transport import receive_secrets

PEERS_TIMEOUT_S = 120.0  # every container starts within seconds of the others; a torch import is ~2 s
POLL_S = 0.2
SECRETS_TIMEOUT_S = 30.0  # the launcher writes the line as it starts the container: it is there at once


def _wait_for_reports(probes: Path, nnodes: int, timeout_s: float) -> None:
    """Return once every node's report is there, or after ``timeout_s`` (the comparison names who is not)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all((probes / f"node-{k}.json").is_file() for k in range(nnodes)):
            return
        time.sleep(POLL_S)


def _secrets() -> dict[str, str]:
    """The launcher's secrets line from stdin. A compose file run by hand (``docker compose up``) keeps
    stdin open with no writer: after SECRETS_TIMEOUT_S the node starts without secrets, and says so."""
    secrets = receive_secrets(SECRETS_TIMEOUT_S)
    if secrets is None:
        print("compose_node: no secrets line on stdin (run by hand?): none given to torchrun", flush=True)
        return {}
    print(f"compose_node: secrets given to torchrun: {', '.join(sorted(secrets)) or 'none'}", flush=True)
    return secrets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.schedulers.compose.node", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--job-dir", type=Path, required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=0)
    parser.add_argument("--skip-parity", action="store_true")
    add_watch_flags(parser)
    args, command = parse_with_command(parser, argv)
    if not command:
        parser.error("the command to run (torchrun ...) goes after --")
    secrets = _secrets()
    probes = args.job_dir / PROBE_DIR
    probes.mkdir(parents=True, exist_ok=True)
    atomic_write_text(probes / f"node-{args.node}.json", collect().model_dump_json() + "\n")
    _wait_for_reports(probes, args.nodes, PEERS_TIMEOUT_S)
    failure = check(args.job_dir, args.nodes, args.gpus_per_node, args.skip_parity, args.node)
    if failure is not None:  # every refusing node reports it: the supervisor may see any one exit first
        return end_step(args.job_dir, failure)
    watch = watch_of(args)
    agent = NodeAgent(
        node=args.node,
        argv=command,
        env=os.environ | secrets,
        report=lambda report: reports.append(args.job_dir, report),  # the job record is mounted
        say=lambda line: print(line, flush=True),
        watch=watch,
        # The pids the ranks beat there are this container's, whose namespace is the host's.
        heartbeat_dir=str(heartbeat_dir(args.job_dir, args.node)) if watch is not None else None,
        subreaper=False,  # the container's init already
    )
    agent.install_signals()  # as the container's init: nothing else passes SIGTERM/SIGINT on
    try:
        return agent.run()
    except OSError as e:
        print(f"compose_node: cannot start {command[0]!r}: {e.strerror}", file=sys.stderr, flush=True)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
