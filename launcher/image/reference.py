"""Image references pinned by digest: a job's nodes pull ``NAME@sha256:…``, never a tag, so a tag
moved while the job runs (or a requeue a week later) never changes the bits its nodes run."""

from __future__ import annotations

import re

from docker.errors import DockerException, NotFound
from docker.utils import parse_repository_tag
from requests import RequestException

from launcher.image.engine import DockerError, connect

_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def is_pinned(ref: str) -> bool:
    """Whether ``ref`` names its content: ``NAME@sha256:<64 hex>``, or an Apptainer ``.sif`` file."""
    return bool(_DIGEST.search(ref)) or ref.endswith(".sif")


def repository(ref: str) -> str:
    """``ref`` without its tag or digest: ``host:5000/team/gpt:cpu`` → ``host:5000/team/gpt``."""
    return parse_repository_tag(ref.split("@", 1)[0])[0]


def qualified(name: str) -> str:
    """``name`` with the registry Docker gives it when it names none (``gpt`` → ``docker.io/library/gpt``,
    ``team/gpt`` → ``docker.io/team/gpt``): podman may search other registries for a short name."""
    head, sep, _ = name.partition("/")
    if sep and ("." in head or ":" in head or head == "localhost"):
        return name
    return f"docker.io/{name}" if sep else f"docker.io/library/{name}"


def resolve(ref: str) -> str:
    """``ref`` pinned to the digest its registry serves now (a pinned ``ref`` unchanged), asked once
    through the Docker engine (``DOCKER_HOST``: its credentials and trusted registries). Raises
    DockerError naming the registry's answer (unknown tag, unreachable, unauthorized) and the fix."""
    if is_pinned(ref):
        return ref
    fix = "push it (`launcher build --tag REF --push`), or pass the digest yourself: --image NAME@sha256:…"
    try:
        client = connect(timeout_s=120)
    except DockerError as e:
        raise DockerError(
            f"image {ref}: its tag is resolved to a digest through the Docker engine: {e}; "
            "or pass the digest yourself: --image NAME@sha256:…"
        ) from None
    try:
        data = client.images.get_registry_data(ref)
    except NotFound:
        raise DockerError(f"image {ref}: the registry has no such tag: {fix}") from None
    except (DockerException, RequestException) as e:
        why = getattr(e, "explanation", None) or e
        raise DockerError(f"image {ref}: cannot ask its registry for the digest ({why}): {fix}") from None
    return f"{qualified(repository(ref))}@{data.id}"
