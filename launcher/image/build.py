"""Building the training image (``launcher build``; ``docs/containers.md``): the build context staged
from this checkout in a temporary directory (the CA bundle and the wheelhouse never touch the checkout),
then the engine's build API followed step by step. The Dockerfile (top level) does the pinning; this
module only chooses its build arguments per variant (``cuda`` or ``cpu``)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import docker
from docker.errors import APIError, DockerException
from requests import RequestException

from launcher.image.engine import DockerError

IMAGE_PYTHON = "3.11"  # the Python of both base images (Debian bookworm, python:3.11-slim-bookworm)
# manylinux tags a wheel for that Python on x86_64 may carry (pip needs each one named).
_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 16, -1)] + ["linux_x86_64"]
CONTEXT = (
    "Dockerfile", ".dockerignore", "pyproject.toml", "constraints.txt", "README.md",
    "gptlaunch", "launcher", "trainer", "deploy/docker/pins",
)  # fmt: skip
WHEELS_DIR = "deploy/docker/wheels"  # the Dockerfile's PIP_FIND_LINKS
CA_FILE = "deploy/docker/certs/ca.crt"  # the Dockerfile's PIP_CERT, in its build stage only
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DOWNLOAD_TIMEOUT_S = 1800  # a torch wheel is hundreds of MB
_STEP = re.compile(r"^Step \d+/\d+ : ")
TAIL_LINES = 25


@dataclass(frozen=True)
class Variant:
    """A build of the Dockerfile: its build arguments and the wheels its wheelhouse must hold."""

    build_args: dict[str, str]
    wheels: tuple[str, ...] = ()  # requirements downloaded into the wheelhouse before the build


def variant(name: str, source: Path) -> Variant:
    """The ``cuda`` or ``cpu`` build of the Dockerfile in ``source``; torch's version comes from the
    variant's pins file (``deploy/docker/pins/<name>.txt``). Raises DockerError for a missing file."""
    pins = source / "deploy" / "docker" / "pins" / f"{name}.txt"
    try:
        text = pins.read_text()
    except OSError as e:
        raise DockerError(
            f"cannot read the pins file {pins} ({e.strerror}): is --context a checkout?"
        ) from None
    if (match := re.search(r"^torch==(\S+)", text, re.MULTILINE)) is None:
        raise DockerError(f"{pins} pins no torch (a line `torch==VERSION`)")
    torch = match.group(1)
    if name == "cuda":  # the Dockerfile's defaults are the CUDA image's pins
        return Variant({"VARIANT": "cuda", "TORCH_VERSION": torch})
    args = {"VARIANT": "cpu", "TORCH_VERSION": torch, "CUDA_VERSION": "", "NCCL_VERSION": ""}
    return Variant(args, wheels=(f"torch=={torch}",))


def stage_context(
    source: Path,
    dest: Path,
    wanted: Variant,
    ca_bundle: Path | None,
    wheelhouse: Path | None,
    index_url: str | None = None,
) -> None:
    """Copy the files the Dockerfile reads from ``source`` to ``dest``, the CA bundle as ``CA_FILE`` and
    the wheels as ``WHEELS_DIR``: from ``wheelhouse`` if given, else downloaded with this machine's pip
    (from ``index_url``, else PyPI and torch's CPU index, through ``ca_bundle`` if given). Raises
    DockerError naming what is missing and the fix (a full disk included)."""
    try:
        for name in CONTEXT:
            path = source / name
            if path.is_dir():
                shutil.copytree(path, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            elif path.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest / name)
            else:
                raise DockerError(f"{path} is missing: --context must be a gptlaunch checkout")
        wheels, ca = dest / WHEELS_DIR, dest / CA_FILE
        wheels.mkdir(parents=True)
        ca.parent.mkdir(parents=True)
        if ca_bundle is not None:
            _copy_ca_bundle(ca_bundle, ca)
        if wheelhouse is not None:
            found = sorted(wheelhouse.glob("*.whl"))
            if not found:
                raise DockerError(f"--wheelhouse {wheelhouse} holds no *.whl file")
            for wheel in found:  # a torch wheel is hundreds of MB: no copy when on the same file system
                try:
                    (wheels / wheel.name).hardlink_to(wheel)
                except OSError:
                    shutil.copy2(wheel, wheels / wheel.name)
        elif wanted.wheels:
            _download(wanted.wheels, wheels, ca_bundle, index_url)
    except OSError as e:  # a full disk, an unreadable file of the checkout
        raise DockerError(
            f"cannot stage the build context in {dest}: {e}; free space or set TMPDIR"
        ) from None


def _copy_ca_bundle(bundle: Path, dest: Path) -> None:
    try:
        text = bundle.read_text(errors="replace")
    except OSError as e:
        raise DockerError(f"--ca-bundle {bundle}: cannot read it ({e.strerror})") from None
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise DockerError(f"--ca-bundle {bundle} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    dest.write_text(text)


def _download(
    requirements: tuple[str, ...], dest: Path, ca_bundle: Path | None, index_url: str | None
) -> None:
    platforms = [arg for p in _PLATFORMS for arg in ("--platform", p)]
    # torch's +cpu builds are on its own index, not on PyPI; a given index (a mirror) replaces both
    index = ["--index-url", index_url] if index_url else ["--extra-index-url", TORCH_CPU_INDEX]
    argv = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--retries", "1", "--implementation", "cp", "--python-version", IMAGE_PYTHON, *platforms,
        "--dest", str(dest),
        *index, *(["--cert", str(ca_bundle)] if ca_bundle else []), *requirements,
    ]  # fmt: skip
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DockerError(f"downloading {' '.join(requirements)} took over {DOWNLOAD_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DockerError(
            f"cannot download {' '.join(requirements)} for the image ({last}): download the wheel "
            f"(`pip download --no-deps {' '.join(requirements)} --index-url "
            f"{TORCH_CPU_INDEX} -d DIR`) and pass --wheelhouse DIR"
        )


class BuildFailed(DockerError):
    """The engine's build stopped at a step; the message names the step, its error and last output."""

    def __init__(self, step: str | None, error: str, tail: list[str], base_image: str | None = None) -> None:
        where = f"at {step}" if step else "before its first step"
        hint = ""
        if step and step.split(" : ", 1)[-1].startswith("FROM "):
            base = base_image or "the Dockerfile's BASE_IMAGE"
            hint = (
                f"\n  the base image {base} is neither in the engine nor pullable: pass another --base-image"
            )
        output = "".join(f"\n  | {line}" for line in tail)
        super().__init__(f"image build failed {where}: {error.strip()}{output}{hint}")


@dataclass
class BuildProgress:
    """What the build printed: the current step, the output since it began, the image id at the end."""

    on_step: Callable[[str], None]
    on_output: Callable[[str], None]
    step: str | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    image_id: str | None = None
    base_image: str | None = None  # named when the FROM step fails

    def feed(self, chunk: dict[str, object]) -> None:
        """One decoded message of the build API. Raises BuildFailed on an ``error`` message."""
        if "error" in chunk:
            raise BuildFailed(self.step, str(chunk["error"]), list(self.tail), self.base_image)
        aux = chunk.get("aux")
        if isinstance(aux, dict) and "ID" in aux:
            self.image_id = str(aux["ID"])
        for line in str(chunk.get("stream", "")).splitlines():
            if _STEP.match(line):
                self.step = line
                self.tail.clear()
                self.on_step(line)
            elif line.strip():
                self.tail.append(line)
                self.on_output(line)


def build(
    client: docker.DockerClient, context: Path, tag: str, build_args: dict[str, str], progress: BuildProgress
) -> str:
    """Build ``context`` as ``tag`` with ``build_args`` on the host network (the build reaches the
    package index as this machine does); returns the image id (``sha256:…``). Raises BuildFailed."""
    try:
        stream = client.api.build(
            path=str(context), tag=tag, buildargs=build_args, rm=True, forcerm=True, decode=True,
            network_mode="host", pull=False,
        )  # fmt: skip
        for chunk in stream:
            progress.feed(chunk)
        return progress.image_id or str(client.images.get(tag).id)
    except APIError as e:
        raise BuildFailed(
            progress.step, e.explanation or str(e), list(progress.tail), progress.base_image
        ) from None
    except (DockerException, RequestException) as e:  # the engine went away or stopped answering
        where = f" at {progress.step}" if progress.step else ""
        raise DockerError(f"the connection to the engine broke during the build{where}: {e}") from None
