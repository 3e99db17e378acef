"""Version parity inside a SLURM job: the step before training.

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
import shlex
import sys
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from launcher.job import reports
from launcher.job.reports import Refused
from launcher.preflight.parity import compare, diff_text, report_table
from launcher.preflight.probe import IMAGE_DIGEST_ENV, Probe
from trainer.contract import EXIT_FAILED, EXIT_REFUSED

PROBE_DIR = "parity"  # in the job directory: node-K.json (report), node-K.log (the probe's stderr)
STEP_TIME_MIN = 5  # srun's limit for the probe step: a cold `import torch` takes seconds, not minutes
PULL_TIME_MIN = 30  # in an image, the step may pull it first (several GB for a CUDA image)


class InImage(Protocol):
    """How a SLURM job runs steps in its image (``launcher.schedulers.slurm.image.SlurmImage``)."""

    @property
    def image(self) -> str: ...
    @property
    def python(self) -> str: ...
    def srun_args(self) -> list[str]: ...
    def probe(self) -> list[str]: ...
    def batch(self, argv: list[str]) -> list[str]: ...


def batch_lines(
    *,
    python: str,
    workdir: str,
    job_dir: str,
    nnodes: int,
    gpus_per_node: int,
    skip: bool,
    in_image: InImage | None = None,
) -> list[str]:
    """The batch script's lines for the step (bash; every value shell-quoted, no variable needed), the
    same in the standalone sbatch script and in submitit's. ``gpus_per_node`` 0: no GPU requirement.
    With ``in_image``, the probe and the comparison run in the job's image (the probe's step may pull
    it: a longer time limit)."""
    probes = Path(job_dir) / PROBE_DIR
    probe = [python, "-m", "launcher.preflight.probe", "--json"]
    minutes = STEP_TIME_MIN
    if in_image is not None:
        probe, python, minutes = [*in_image.srun_args(), *in_image.probe()], in_image.python, PULL_TIME_MIN
    srun = [
        "srun", f"--nodes={nnodes}", "--ntasks-per-node=1", f"--time={minutes}", f"--chdir={workdir}",
        f"--output={probes}/node-%n.json", f"--error={probes}/node-%n.log", *probe,
    ]  # fmt: skip
    compare_argv = [
        python, "-m", "launcher.preflight.parity_step", "--job-dir", job_dir, "--nodes", str(nnodes),
        "--gpus-per-node", str(gpus_per_node), *(["--skip-parity"] if skip else []),
    ]  # fmt: skip
    if in_image is not None:
        compare_argv = in_image.batch(compare_argv)
    q = shlex.quote
    # The image the probe (and, later in the batch script, every node) runs in, as it reports it: pyxis
    # and Apptainer pass the batch environment on (podman sets it itself).
    digest = [f"export {IMAGE_DIGEST_ENV}={q(in_image.image)}"] if in_image is not None else []
    return [
        "# Version parity: probe every node (one srun step), compare here; a mismatch ends the job (exit 3).",
        *digest,
        f"rm -rf -- {q(str(probes))} && mkdir -p -- {q(str(probes))}",
        f"{shlex.join(srun)} || true  # a node without a report is named by the comparison",
        f"(cd -- {q(workdir)} && {shlex.join(compare_argv)}) || exit $?",
    ]


def _read_probes(probes: Path, nnodes: int) -> tuple[dict[str, Probe], list[str]]:
    """Each node's report, keyed "hostname (node K)"; and a line per node that gave none."""
    found, missing = {}, []
    for node in range(nnodes):
        report, log = probes / f"node-{node}.json", probes / f"node-{node}.log"
        try:
            probe = Probe.model_validate_json(report.read_text().strip().splitlines()[-1])
        except (OSError, IndexError, ValueError, ValidationError):
            missing.append(f"  node {node}: no probe report ({report}); its errors: {log}")
            continue
        found[f"{probe.hostname} (node {node})"] = probe
    return found, missing


def check(job_dir: Path, nnodes: int, gpus_per_node: int, skip: bool, node: int = 0) -> Refused | None:
    """Compare the nodes' reports; print the table, and the diff when they differ (to stderr). Returns the
    refusal (as node ``node`` sends it) that ends the job: exit 3 for a mismatch, 1 when a node gave no
    report; None to go on (they match, or ``skip`` and they only differ)."""
    probes, missing = _read_probes(job_dir / PROBE_DIR, nnodes)
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
