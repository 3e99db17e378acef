"""What the cluster's partition offers a job, from ``sinfo``: whether its nodes have GPUs."""

from __future__ import annotations

import subprocess

from launcher.job.console import say
from launcher.job.spec import JobSpec
from launcher.schedulers.slurm.options import SlurmOptions


def partition_gres(partition: str | None) -> str | None:
    """The GRES of the partition's nodes (``sinfo``'s ``%G``, one per line: ``gpu:8``, ``(null)``),
    None when sinfo cannot tell."""
    argv = ["sinfo", "--noheader", "--format=%G", *([f"--partition={partition}"] if partition else [])]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return " ".join(sorted(set(out.split())))


def gpus_asked(spec: JobSpec, opts: SlurmOptions) -> bool:
    """Whether the job requests GPUs: as ``--slurm-gpus`` says, else when the partition's nodes have
    GPU GRES (or sinfo cannot tell: the GPU clusters this is for). Never silently none: a job that
    requests none for that reason says so, naming the GRES and the flag."""
    if opts.gpus is not None:
        return opts.gpus
    gres = partition_gres(opts.partition)
    if gres is None or "gpu" in gres:
        return True
    where = f"partition {opts.partition}" if opts.partition else "the default partition"
    say(
        f"launcher: note: the nodes of {where} have no GPU in their GRES (sinfo: {gres or 'none'}): no "
        f"GPUs are requested, and each node runs {spec.nproc_per_node} CPU process(es); --slurm-gpus "
        "requests them"
    )
    return False
