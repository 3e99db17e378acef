"""Version parity inside a SLURM job: the step before training (its batch script lines:
``launcher.schedulers.slurm.steps``).

The batch script runs ``python -m launcher.preflight.probe --json`` on every allocated node (one
``srun`` step, each node's report in ``<job dir>/parity/node-K.json``, its stderr in ``node-K.log``),
then this module on the batch node: it compares the reports (``launcher.preflight.parity``) and exits 3
(EXIT_REFUSED) with the field-by-field diff when a must-match field differs or a node has too few GPUs,
so the job ends before any rank starts. A requeued job runs the step again: it may land on other nodes.

A failed step sends a ``launcher.job.reports.Refused`` report (the exit code and the diff; the health
gate's step sends one too), from which the SLURM scheduler tells how the job ended
(``launcher.schedulers.slurm.state.end_outcome``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gptlaunch.contract import EXIT_FAILED, EXIT_REFUSED
from launcher.job import reports
from launcher.job.measurements import Probe
from launcher.job.reports import Refused
from launcher.preflight.parity import compare, diff_text, report_table

PROBE_DIR = "parity"  # in the job directory: node-K.json (report), node-K.log (the probe's stderr)


def read_probes(probes: Path, nnodes: int) -> tuple[dict[int, Probe], list[str]]:
    """Each node's report, by node rank; and a line per node that gave none."""
    found, missing = {}, []
    for node in range(nnodes):
        report, log = probes / f"node-{node}.json", probes / f"node-{node}.log"
        try:
            probe = Probe.model_validate_json(report.read_text().strip().splitlines()[-1])
        except (OSError, IndexError, ValueError):  # ValueError: pydantic's ValidationError too
            missing.append(f"  node {node}: no probe report ({report}); its errors: {log}")
            continue
        found[node] = probe
    return found, missing


def by_name(probes: dict[int, Probe]) -> dict[str, Probe]:
    """``probes`` keyed by hostname, or "hostname (node K)" where two nodes share a hostname."""
    names = [p.hostname for p in probes.values()]
    unique = len(set(names)) == len(names)
    return {(p.hostname if unique else f"{p.hostname} (node {k})"): p for k, p in probes.items()}


def check(job_dir: Path, nnodes: int, gpus_per_node: int, skip: bool, node: int = 0) -> Refused | None:
    """Compare the nodes' reports; print the table, and the diff when they differ (to stderr). Returns the
    refusal (as node ``node`` sends it) that ends the job: exit 3 for a mismatch, 1 when a node gave no
    report; None to go on (they match, or ``skip`` and they only differ)."""
    found, missing = read_probes(job_dir / PROBE_DIR, nnodes)
    probes = {f"{p.hostname} (node {k})": p for k, p in found.items()}
    if missing:
        message = "version parity: the probe failed on some nodes:\n" + "\n".join(missing)
        return Refused(node=node, check="parity", exit_code=EXIT_FAILED, message=message)
    print(report_table(probes), flush=True)
    mismatches, shortfalls = compare(probes, gpus_per_node)
    if not mismatches and not shortfalls:
        print(f"version parity: the {nnodes} nodes match", flush=True)
        return None
    diff = diff_text(mismatches, shortfalls)
    if skip:
        print(f"WARNING (--skip-parity: training anyway): {diff}", file=sys.stderr, flush=True)
        return None
    return Refused(node=node, check="parity", exit_code=EXIT_REFUSED, message=diff)


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.preflight.parity_step``: 0 to go on, 3 on a mismatch, 1 when a node gave no
    report."""
    parser = argparse.ArgumentParser(
        prog="python -m launcher.preflight.parity_step",
        description="Compare the probe reports of a SLURM job's nodes (run by the job's batch script).",
        allow_abbrev=False,
    )
    parser.add_argument("--job-dir", type=Path, required=True, help="the job directory (reports in parity/)")
    parser.add_argument("--nodes", type=int, required=True, help="the number of nodes that were probed")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs each node needs (0: none)")
    parser.add_argument("--skip-parity", action="store_true", help="warn about a mismatch, exit 0")
    args = parser.parse_args(argv)
    return end_step(args.job_dir, check(args.job_dir, args.nodes, args.gpus_per_node, args.skip_parity))


def end_step(job_dir: Path, refused: Refused | None) -> int:
    """A batch step's exit status: 0 to go on, else the refusal's, once it is reported (and printed)."""
    if refused is None:
        return 0
    reports.append(job_dir, refused)
    print(refused.message, file=sys.stderr, flush=True)
    return refused.exit_code


if __name__ == "__main__":
    sys.exit(main())
