"""The Docker engine, through the Docker SDK (``docker`` package): one way to connect, one kind of
error. The engine is the one ``DOCKER_HOST`` names (with ``DOCKER_TLS_VERIFY``, ``DOCKER_CERT_PATH``),
else the default socket; docker contexts are not read (the SDK does not), so the docker CLI calls of a
job are given the same variables (``engine_env``)."""

from __future__ import annotations

import os

import docker
from docker.errors import DockerException

from launcher.job.spec import SpecError

API_TIMEOUT_S = 3600  # one API call may stream a whole build or a long `docker start -a`
PING_TIMEOUT_S = 15  # an engine that does not answer a ping in this long is not there
DEFAULT_HOST = "unix:///var/run/docker.sock"  # the SDK's engine when DOCKER_HOST is unset
ENGINE_VARIABLES = ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH")
DEV_ENGINE = "deploy/docker/dev-engine.sh up"


class DockerError(SpecError):
    """The engine cannot do what was asked (unreachable, missing image, failed build); the message
    names the cause and the fix. Exit code 2, as for any input that cannot run."""


def connect(timeout_s: int = API_TIMEOUT_S) -> docker.DockerClient:
    """A client of the engine that answers. Raises DockerError naming ``DOCKER_HOST`` when none does."""
    where = os.environ.get("DOCKER_HOST") or f"the default socket ({DEFAULT_HOST})"
    try:
        client = docker.from_env(timeout=PING_TIMEOUT_S)
        client.ping()
        client.api.timeout = timeout_s  # then as long as a build or an attach may take
    except DockerException as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DockerError(
            f"cannot reach the Docker engine at {where} ({why}): start it, or set DOCKER_HOST "
            f"to one that runs (without Docker Desktop: `sudo {DEV_ENGINE}`, then export the DOCKER_HOST "
            "it prints)"
        ) from None
    return client


def engine_env() -> dict[str, str]:
    """The variables that point the docker CLI at the engine ``connect()`` reaches (DOCKER_HOST set
    even when it was not: the CLI would follow a docker context the SDK ignores)."""
    found = {name: os.environ[name] for name in ENGINE_VARIABLES if os.environ.get(name)}
    return {"DOCKER_HOST": DEFAULT_HOST} | found


def with_engine(recorded: dict[str, str]) -> dict[str, str]:
    """This process's environment with the engine variables replaced by ``recorded`` (from
    ``engine_env()`` at submit): a TLS setting of the current shell must not reach another engine."""
    kept = {name: value for name, value in os.environ.items() if name not in ENGINE_VARIABLES}
    return kept | recorded
