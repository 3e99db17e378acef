"""The checks before training as a job record keeps them, on every scheduler that runs them: version
parity's probes in ``JOB/parity/node-K.json`` and the health gate's result in ``JOB/health/`` (rank
0's ``CollectiveDone`` report, and the node names in ``hosts``). SLURM's steps write both there inside
the job (``parity_step``, ``health_step``; a requeue runs them again and archives the earlier ones with
its attempt), compose's parity step its probes; an SSH submit, which runs the checks from this machine
before the record exists, writes them once it does (``write``): those of the hosts it submitted to (a
retry that swaps a host for a spare checks the spare, and does not record it). Read by ``launcher
report`` and the job's TensorBoard scalars."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gptlaunch.files import atomic_write_text
from launcher.job import reports
from launcher.job.measurements import CollectiveResult, Probe
from launcher.job.reports import CollectiveDone
from launcher.preflight.health_step import HEALTH_DIR, HOSTS, node_names
from launcher.preflight.parity_step import PROBE_DIR, by_name, read_probes


@dataclass(frozen=True)
class Checks:
    """What the checks found: ``probes`` keyed by hostname (``parity_step.by_name``; empty: no parity
    check recorded), ``health`` (None: no health gate), ``hosts``: the node names by node rank."""

    probes: dict[str, Probe]
    health: CollectiveResult | None
    hosts: list[str]


def write(job_dir: Path, probes: list[Probe], health: CollectiveResult | None, hosts: list[str]) -> None:
    """Record the checks of a job on ``hosts`` (node rank order): each node's probe (``probes``, in the
    same order) and the health gate's result. Raises OSError."""
    if probes:
        (job_dir / PROBE_DIR).mkdir(parents=True, exist_ok=True)
    for node, probe in enumerate(probes):
        atomic_write_text(job_dir / PROBE_DIR / f"node-{node}.json", probe.model_dump_json() + "\n")
    if health is not None:
        (job_dir / HEALTH_DIR).mkdir(parents=True, exist_ok=True)
        atomic_write_text(job_dir / HEALTH_DIR / HOSTS, "\n".join(hosts) + "\n")
        reports.append_to(job_dir / HEALTH_DIR, "node-0", CollectiveDone(node=0, rank=0, result=health))


def read(job_dir: Path, nnodes: int) -> Checks:
    """The checks recorded for the job of ``nnodes`` nodes in ``job_dir`` (the last run's, after a
    requeue): what is missing or unreadable is left out."""
    probes, _ = read_probes(job_dir / PROBE_DIR, nnodes)
    done = reports.read_dir(job_dir / HEALTH_DIR, CollectiveDone)
    return Checks(
        by_name(probes), done[-1].result if done else None, node_names(job_dir / HEALTH_DIR, nnodes)
    )
