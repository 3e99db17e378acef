"""The Docker engine, through the Docker SDK (``docker`` package): one way to connect, one kind of
error. The engine is found as the docker CLI finds it (``DOCKER_HOST``, ``DOCKER_TLS_VERIFY``,
``DOCKER_CERT_PATH``; else the default socket)."""

from __future__ import annotations

import os

import docker
from docker.errors import DockerException

from launcher.spec import SpecError

API_TIMEOUT_S = 3600  # one API call may stream a whole build or a long `docker start -a`
DEV_ENGINE = "deploy/docker/dev-engine.sh up"


class DockerError(SpecError):
    """The engine cannot do what was asked (unreachable, missing image, failed build); the message
    names the cause and the fix. Exit code 2, as for any input that cannot run."""


def connect(timeout_s: int = API_TIMEOUT_S) -> docker.DockerClient:
    """A client of the engine that answers. Raises DockerError naming ``DOCKER_HOST`` when none does."""
    where = os.environ.get("DOCKER_HOST") or "the default socket (unix:///var/run/docker.sock)"
    try:
        client = docker.from_env(timeout=timeout_s)
        client.ping()
    except DockerException as e:
        raise DockerError(
            f"cannot reach the Docker engine at {where} ({_first_line(e)}): start it, or set DOCKER_HOST "
            f"to one that runs (without Docker Desktop: `sudo {DEV_ENGINE}`, then export the DOCKER_HOST "
            "it prints)"
        ) from None
    return client


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
