"""The training image on SLURM nodes, one way per container runtime (``--container-runtime``):

- **pyxis** (enroot's SPANK plugin): ``srun --container-image=REGISTRY#NAME@sha256:… --container-mounts=…
  --container-workdir=… --no-container-mount-home``: the whole node task runs in the image.
- **apptainer**: ``apptainer exec [--nv] --bind … --pwd … docker://NAME@sha256:…`` (or a ``.sif`` file)
  in front of the node task: it runs in the image.
- **podman**: the node task runs on the host (its Python, as submitit needs) and starts torchrun in a
  podman container it supervises and removes (``launcher.image.runtime``), as the SSH host agent does.

Everything the image runs uses the image's interpreter (``IMAGE_PYTHON``); the parity comparison and
the health gate's judgment (``--health-check``) of the batch script run in the image too, except with
podman, whose tasks need the host's Python anyway. The retry step of ``--retries`` runs on the batch
host's Python (it calls ``scontrol``).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from launcher.image.runtime import exec_argv
from launcher.job.plan import Facts
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import IMAGE_PYTHON, container_mounts

PYXIS_FLAG = "--container-image"


class SlurmFacts(Facts):
    gpus_per_node: int  # GPUs requested per node; 0 for CPU processes
    image: str | None = None  # pinned by digest (or an Apptainer .sif file): what every node runs
    runtime: str | None = None  # with an image: pyxis, apptainer or podman


def pick_runtime(wanted: str) -> str:
    """The runtime of ``--container-runtime`` ("auto": pyxis when this cluster's srun has it, else
    apptainer, else podman, as found on this login node). Raises SpecError when none is found."""
    if wanted != "auto":
        return wanted
    try:
        helps = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        helps = ""
    if PYXIS_FLAG in helps:
        return "pyxis"
    for runtime in ("apptainer", "podman"):
        if shutil.which(runtime):
            return runtime
    raise SpecError(
        "no container runtime found for --image on this cluster (srun without pyxis's --container-image, "
        "no apptainer or podman on PATH): pass --container-runtime pyxis|apptainer|podman"
    )


@dataclass(frozen=True)
class SlurmImage:
    """The job's image (pinned by digest, or an Apptainer ``.sif`` file) under ``runtime``, with the
    host directories ``mounts`` at the same paths and ``workdir`` as the working directory."""

    image: str
    runtime: str  # pyxis, apptainer or podman
    mounts: tuple[str, ...]
    workdir: str
    host_python: str  # the spec's interpreter: podman's node task runs on the host
    gpus: bool

    def header(self) -> list[str]:
        """The sbatch script's comment lines on what the nodes need."""
        lines = [
            f"# The nodes run the image {self.image} with {self.runtime}: torch and the trainer come from it."
        ]
        if self.runtime == "podman":
            lines.append(
                "# The node task runs on the interpreter below (with this project): it starts the container."
            )
        return lines

    @property
    def python(self) -> str:
        """The interpreter of the node task and the batch steps: the image's, or podman's host one."""
        return self.host_python if self.runtime == "podman" else IMAGE_PYTHON

    def srun_args(self) -> list[str]:
        """srun's options that put a step in the image (pyxis); none for the other runtimes."""
        if self.runtime != "pyxis":
            return []
        return [
            f"--container-image={pyxis_image(self.image)}",
            f"--container-mounts={','.join(f'{m}:{m}' for m in self.mounts)}",
            f"--container-workdir={self.workdir}",
            "--no-container-mount-home",
        ]

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs in the image on a node (apptainer's prefix; as is for the
        others: pyxis puts the whole srun step in the image, podman's task starts the container)."""
        if self.runtime != "apptainer":
            return argv
        source = self.image if self.image.endswith(".sif") else f"docker://{self.image}"
        binds = ["--bind", ",".join(self.mounts)] if self.mounts else []
        return [
            "apptainer",
            "exec",
            *(["--nv"] if self.gpus else []),
            *binds,
            "--pwd",
            self.workdir,
            source,
            *argv,
        ]

    def batch(self, argv: list[str]) -> list[str]:
        """``argv`` as a step of the batch script (on the allocation's first node) in the image: with
        pyxis, a one-task srun step in the container."""
        if self.runtime == "pyxis":
            return ["srun", "--nodes=1", "--ntasks=1", *self.srun_args(), *argv]
        return self.wrap(argv)

    def run(self, argv: list[str], env_names: Iterable[str] = ()) -> list[str]:
        """``argv`` in the image on a node, as a step's task (podman: in a throwaway container with the
        host's network and GPUs, pulled first if missing, ``env_names`` passed in; pyxis also needs
        ``srun_args``; pyxis and apptainer pass the environment on themselves)."""
        if self.runtime == "podman":
            return exec_argv(self.host_python, "podman", self.image, argv, env_names)
        return self.wrap(argv)


def pyxis_image(ref: str) -> str:
    """An image reference in enroot's form: the registry (a host with a dot or a port, or localhost)
    separated by ``#``: ``10.0.0.1:5000/team/gpt@sha256:…`` → ``10.0.0.1:5000#team/gpt@sha256:…``."""
    head, sep, rest = ref.partition("/")
    if sep and ("." in head or ":" in head or head == "localhost"):
        return f"{head}#{rest}"
    return ref


def job_image(spec: JobSpec, facts: SlurmFacts, job_dir: Path, run_dir: str) -> SlurmImage | None:
    """How the job's nodes run its image (None: on the nodes' own Python)."""
    if facts.image is None or facts.runtime is None:
        return None
    mounts = container_mounts(spec, run_dir, facts.workdir, job_dir)
    return SlurmImage(facts.image, facts.runtime, mounts, facts.workdir, spec.python, facts.gpus_per_node > 0)
