"""The external programs the launcher and its node agents run, where each is needed, and the package
that provides it: one list, so that a job that needs one is refused before any rank starts (exit 2 for
this machine, 3 for a host, naming the package), and so that the test suite's set-up installs every
one (``tests/unit/test_programs.py`` finds the programs the code runs and checks them against it).

Package names are Debian's and Ubuntu's (the distributions the dev clusters and images use); a
program that comes with a Python package of the launcher's own dependencies names that instead.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Program:
    """An external program: ``name`` on PATH, the ``package`` to install for it (``pip:NAME`` for a
    Python package), what it is ``used_for``, and, when a job runs without it, ``optional``: what is
    lost then (None: a job that needs it is refused)."""

    name: str
    package: str
    used_for: str
    optional: str | None = None

    def install_hint(self) -> str:
        """How to get it, for an error message: ``apt-get install rsync`` or ``pip install py-spy``."""
        if self.package.startswith("pip:"):
            return f"pip install {self.package.removeprefix('pip:')} (in the job's Python environment)"
        name = self.package
        return f"install the {name} package (apt-get install {name}, or dnf install {name})"


RSYNC = Program("rsync", "rsync", "copies to and from hosts that share no file system")
SSH = Program("ssh", "openssh-client", "the SSH scheduler's connections to its hosts")
PY_SPY = Program(
    "py-spy",
    "pip:py-spy",
    "the Python stacks of a hung rank",
    optional="a hang is still detected and ended, but reported without the ranks' Python stacks",
)
PODMAN = Program("podman", "podman", "--image on SSH hosts and SLURM nodes (with docker, either one)")
DOCKER = Program("docker", "docker.io", "launcher build, the compose scheduler, --container-runtime docker")
DOCKER_COMPOSE = Program("docker-compose", "docker-compose", "the compose scheduler without `docker compose`")
APPTAINER = Program(
    "apptainer", "apptainer", "--container-runtime apptainer on SLURM", optional="another runtime is used"
)
NVIDIA_SMI = Program(
    "nvidia-smi",
    "the NVIDIA driver",
    "GPU facts in the probe and the health check",
    optional="the driver's version comes from /proc; the health check's GPU fields stay empty",
)
IP = Program("ip", "iproute2", "the probe's route to master_addr", optional="the route is taken from psutil")
SLURM = tuple(
    Program(name, "slurm-client", "the SLURM scheduler")
    for name in ("sbatch", "srun", "scancel", "scontrol", "sinfo")
)

PROGRAMS: tuple[Program, ...] = (
    RSYNC, SSH, PY_SPY, PODMAN, DOCKER, DOCKER_COMPOSE, APPTAINER, NVIDIA_SMI, IP, *SLURM
)  # fmt: skip


def find(program: Program) -> str | None:
    """The path of ``program`` here: on PATH, or beside this Python (a virtualenv's ``bin`` that is not
    on PATH, where ``pip install`` puts ``py-spy``); None when it is not installed."""
    beside = Path(sys.executable).parent / program.name
    return str(beside) if beside.is_file() else shutil.which(program.name)


def missing(program: Program, why: str, where: str = "this machine") -> str:
    """The error for ``program`` not installed on ``where``; ``why`` says what of the job needs it,
    e.g. "--sync"."""
    return (
        f"{why} needs {program.name} ({program.used_for}), which is not installed on {where}: "
        f"{program.install_hint()}"
    )
