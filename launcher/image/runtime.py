"""The training image on a node, through its container runtime (docker or podman): the pull by digest,
the ``run`` of a node's command and the removal of its container. The SSH host agent and the SLURM
node task use it on the node itself, so it imports nothing heavy (no Docker SDK, no torch).

``python -m launcher.image.runtime exec`` runs a command (the version probe) in a throwaway container
of the image, with the host's network and GPUs. The pull on each SSH host before a job is the node
agent's (``python -m launcher.agent pull``: a ``Pulled`` report on its channel).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from launcher.job.hang import parse_with_command
from launcher.job.programs import DOCKER, PODMAN
from launcher.preflight.probe import IMAGE_DIGEST_ENV

RUNTIMES = ("podman", "docker")  # what a node may run images with; "auto" takes the first it has
NO_RUNTIME = "no container runtime"  # how the error of a host without one begins (``pick``)
PACKAGES = {p.name: p.package for p in (PODMAN, DOCKER)}  # the runtime -> the package to install
PULL_TIMEOUT_S = 1800.0  # a CUDA image is several GB
REMOVE_TIMEOUT_S = 60.0


class ContainerError(OSError):
    """The host has no such runtime, or the runtime failed (a pull the registry refused); the message
    is the runtime's own last line of error."""


def pick(wanted: str) -> str:
    """The runtime to use on this host: ``wanted``, or with "auto" the first of RUNTIMES it has.
    Raises ContainerError when the host has none of them."""
    candidates = RUNTIMES if wanted == "auto" else (wanted,)
    for runtime in candidates:
        if shutil.which(runtime):
            return runtime
    packages = " or ".join(PACKAGES[r] for r in candidates)
    raise ContainerError(f"{NO_RUNTIME} ({' or '.join(candidates)}) on this host's PATH: install {packages}")


def has_gpus() -> bool:
    """Whether this host has NVIDIA GPUs to pass into a container (the driver's control device)."""
    return Path("/dev/nvidiactl").exists()


@dataclass(frozen=True)
class Container:
    """One container of ``image`` (pinned by digest) on this host, named ``name``."""

    runtime: str  # docker or podman
    image: str
    name: str
    mounts: tuple[str, ...] = ()  # host directories, mounted at the same paths
    workdir: str = "/"

    def run_argv(
        self,
        command: Iterable[str],
        env_names: Iterable[str] = (),
        gpus: bool = False,
        user: str | None = None,
    ) -> list[str]:
        """``RUNTIME run`` of ``command``: removed at its end; the host's network; the host's IPC
        namespace (NCCL's shared memory is the host's /dev/shm: no --shm-size, which podman refuses
        with it); the host's PID namespace (the host agent and the hang watchdog see the ranks as
        host processes); ``env_names`` passed through from the caller's environment (no value on
        the command line: secrets among them); GPUs the runtime's way."""
        argv = [
            self.runtime, "run", "--rm", f"--name={self.name}", "--network=host", "--ipc=host", "--pid=host",
            f"--workdir={self.workdir}", f"--env={IMAGE_DIGEST_ENV}={self.image}",
            "--env=HOME=/tmp",  # a uid the image does not know has HOME=/, where caches cannot be written
        ]  # fmt: skip
        if user is not None:
            argv.append(f"--user={user}")
            if self.runtime == "podman" and os.getuid() != 0:  # rootless: the files it writes stay ours
                argv.append("--userns=keep-id")
        argv += [f"--volume={path}:{path}" for path in self.mounts]
        argv += [f"--env={name}" for name in sorted(set(env_names))]
        if gpus:  # docker: the NVIDIA container toolkit's hook; podman: its CDI spec
            argv += ["--gpus=all"] if self.runtime == "docker" else ["--device=nvidia.com/gpu=all"]
        return [*argv, self.image, *command]

    def remove(self) -> None:
        """Remove the container now, running or not (SIGKILL); errors (already gone) are ignored."""
        timeout = ["--time=0"] if self.runtime == "podman" else []
        argv = [self.runtime, "rm", "--force", *timeout, self.name]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(argv, capture_output=True, timeout=REMOVE_TIMEOUT_S, check=False)


@dataclass(frozen=True)
class ImageRun:
    """How a node agent (the SSH host agent, the SLURM node task) runs its command in the job's image:
    its ``--image``, ``--runtime``, ``--mount`` and ``--env-name`` flags."""

    image: str
    runtime: str
    mounts: tuple[str, ...]
    env_names: tuple[str, ...]
    # The container's working directory ("": the agent's own, as on an SSH host and in the sbatch
    # script's srun step; a submitit task starts where `launcher submit` ran, not in the job's workdir).
    workdir: str = ""

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--image", help="the image (pinned by digest) the command runs in")
        parser.add_argument(
            "--runtime",
            choices=["auto", *RUNTIMES],
            default="podman",
            help="what runs --image (auto: pull only)",
        )
        parser.add_argument("--mount", action="append", default=[], help="a directory the container mounts")
        parser.add_argument("--env-name", action="append", default=[], help="a variable the container gets")

    def flags(self) -> list[str]:
        """The ``add_flags`` flags that give this run back (``of``), for a node's command line."""
        flags = [f"--image={self.image}", f"--runtime={self.runtime}", *(f"--mount={m}" for m in self.mounts)]
        return [*flags, *(f"--env-name={name}" for name in sorted(set(self.env_names)))]

    @classmethod
    def of(cls, args: argparse.Namespace) -> ImageRun | None:
        """From parsed ``add_flags`` flags (None without --image)."""
        if not args.image:
            return None
        return cls(args.image, args.runtime, tuple(args.mount), tuple(args.env_name))

    def container(self, name: str, mounts: Iterable[str] = ()) -> Container:
        """The container ``name`` in ``workdir`` (default: the current directory), with ``mounts``
        besides the flags'."""
        return Container(self.runtime, self.image, name, (*self.mounts, *mounts), self.workdir or os.getcwd())

    def argv(self, container: Container, argv: list[str], env_names: Iterable[str]) -> list[str]:
        """``argv`` run in ``container`` as this user, with the flags' variables and ``env_names``."""
        for path in container.mounts:  # a run dir not made yet: a runtime refuses a missing source
            os.makedirs(path, exist_ok=True)
        names = [*self.env_names, *env_names]
        return container.run_argv(argv, names, gpus=has_gpus(), user=f"{os.getuid()}:{os.getgid()}")


def exec_argv(
    python: str, runtime: str, image: str, command: list[str], env_names: Iterable[str] = ()
) -> list[str]:
    """``python -m launcher.image.runtime exec``: ``command`` in a throwaway container of ``image``,
    run on a node by the node's ``python``, with ``env_names`` passed in from its environment."""
    flags = [f"--runtime={runtime}", f"--image={image}", *(f"--env-name={name}" for name in env_names)]
    return [python, "-m", "launcher.image.runtime", "exec", *flags, "--", *command]


def pull(runtime: str, image: str) -> float:
    """Pull ``image`` with ``runtime``; returns the seconds it took. Raises ContainerError with the
    runtime's last line of error (the registry's answer)."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [runtime, "pull", "--quiet", image], capture_output=True, text=True, timeout=PULL_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ContainerError(f"{runtime} pull {image}: {e}") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        raise ContainerError(f"{runtime} pull {image}: {lines[-1]}")
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.image.runtime", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["exec"])
    p.add_argument("--runtime", default="auto", choices=["auto", *RUNTIMES])
    p.add_argument("--image", required=True)
    p.add_argument("--env-name", action="append", default=[], help="exec: pass this variable in (repeatable)")
    args, command = parse_with_command(p, argv)  # exec: the command after --
    try:
        runtime = pick(args.runtime)
    except ContainerError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    container = Container(runtime, args.image, f"gptlaunch-exec-{os.getpid()}")
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a step's time limit, a lost ssh connection
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    try:
        return subprocess.run(container.run_argv(command, args.env_name, gpus=has_gpus())).returncode
    finally:
        container.remove()


if __name__ == "__main__":
    sys.exit(main())
