"""The health gate inside a SLURM job: the step after version parity, before training (its batch
script lines: ``launcher.schedulers.slurm.steps``; for users: docs/health-check.md, "On SLURM").

The batch script runs the collective preflight with the gate's stages on every allocated node (node
K's output in ``<job dir>/health/node-K.out``, its errors in ``node-K.log``, the workers' reports
beside them), then this module on the batch node. It judges rank 0's result
(``launcher.preflight.health``), prints the report to the batch log and, when a node is named, ends
the job with exit code 3 (EXIT_REFUSED) and a ``launcher.job.reports.Refused`` report of the message
and the named node ranks, read by ``launcher.schedulers.slurm.state`` and by the job's controller,
which retries without those nodes (``--retries``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gptlaunch.contract import EXIT_REFUSED, EXIT_USAGE
from launcher.job import reports
from launcher.job.reports import Refused
from launcher.preflight.health import GateSettings, findings, named_text, report_text
from launcher.preflight.parity_step import end_step

HEALTH_DIR = "health"  # in the job directory: node-K.out (the workers' output), node-K.log, hosts
HOSTS = "hosts"  # the allocation's node names in node-rank (SLURM_NODEID) order, one per line


def node_names(health: Path, nnodes: int) -> list[str]:
    """The node names by node rank (``node K`` where the batch shell could not write them)."""
    try:
        names = (health / HOSTS).read_text().split()
    except (OSError, ValueError):  # missing, or not text
        names = []
    return names if len(names) == nnodes else [f"node {k}" for k in range(nnodes)]


def check(job_dir: Path, nnodes: int, gate: GateSettings, warn: bool) -> Refused | None:
    """Judge the workers' reports and print the report. Returns the refusal that ends the job (exit 3
    naming nodes, or exit 2 when the gate could not run), None to go on."""
    health = job_dir / HEALTH_DIR
    hosts = node_names(health, nnodes)
    done = reports.read_dir(health, reports.CollectiveDone)
    if not done:
        errors = [f.error.message for f in reports.read_dir(health, reports.CollectiveFailed)]
        errors = errors or [f"no result from rank 0: see {health}/node-*.log"]
        message = "health gate: the collective preflight failed:\n  " + "\n  ".join(errors)
        # As on SSH hosts: exit 2, not a node to retry without. Sent by the judging node, node 0.
        return Refused(node=0, check="health", exit_code=EXIT_USAGE, message=message)
    result = done[-1].result
    found = findings(result, hosts, {}, gate)
    print(report_text(result, hosts, found), flush=True)
    named = [f for f in found if f.fatal]
    if not named:
        return None
    if warn:
        print(
            "WARNING: --health-check-warn: training although the health gate named the node(s) above",
            flush=True,
        )
        return None
    nodes = sorted({hosts.index(f.host) for f in named})
    message = named_text(named, "node")
    return Refused(node=0, check="health", exit_code=EXIT_REFUSED, message=message, nodes=nodes)


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.preflight.health_step``: 0 to go on, 3 when a node is named, 2 when the gate
    could not run (as on SSH hosts, where the launch is refused)."""
    parser = argparse.ArgumentParser(
        prog="python -m launcher.preflight.health_step",
        description="Judge the health gate of a SLURM job's nodes (run by the job's batch script).",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--job-dir", type=Path, required=True, help=f"the job directory (output in {HEALTH_DIR}/)"
    )
    parser.add_argument("--nodes", type=int, required=True, help="the number of nodes in the gate")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="GPUs each node with GPUs needs")
    parser.add_argument("--min-busbw", type=float, help="GB/s: a node whose pairs are all below it is named")
    parser.add_argument("--warn", action="store_true", help="report the named nodes, exit 0")
    args = parser.parse_args(argv)
    gate = GateSettings(min_busbw=args.min_busbw, gpus_per_node=args.gpus_per_node)
    return end_step(args.job_dir, check(args.job_dir, args.nodes, gate, args.warn))


if __name__ == "__main__":
    sys.exit(main())
