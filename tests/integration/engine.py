"""The dev Docker engine (``deploy/docker/dev-engine.sh``) and the CPU training image built on it once
per session, for the image and compose tests (the fixtures reach them through ``conftest``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import missing_component
from tests.integration.conftest import launcher, run

# The Docker engine of deploy/docker/dev-engine.sh, and the CPU training image built on it once.
ENGINE_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "dev-engine.sh"
SYSTEM_CA = Path("/etc/ssl/certs/ca-certificates.crt")  # this machine's TLS is re-signed by a local CA
CA_CANARY = "gptlaunch-ca-canary-5e0b7d"
TAG = "gptlaunch-test:cpu"


@pytest.fixture(scope="session")
def engine() -> dict[str, str]:
    """DOCKER_HOST of the dev engine and the name of its offline base image, from `dev-engine.sh up`."""
    problem = None
    if os.geteuid() != 0:
        problem = "the dev Docker engine needs root"
    else:
        proc = run(["bash", str(ENGINE_SCRIPT), "up"], timeout=900)
        if proc.returncode != 0:
            problem = f"dev-engine.sh up failed:\n{proc.stderr[-3000:]}"
    if problem is not None:
        missing_component(problem)
    base, host = proc.stdout.strip().splitlines()[-2:]
    return {"DOCKER_HOST": host, "BASE_IMAGE": base}


def docker(engine: dict[str, str], *args: str, check: bool = True) -> str:
    proc = run(["docker", *args], env={"DOCKER_HOST": engine["DOCKER_HOST"]}, check=check, timeout=600)
    return proc.stdout


@pytest.fixture(scope="session")
def ca_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This machine's CA bundle (builds reach PyPI only through it) with a canary line that must not
    reach the image."""
    path = tmp_path_factory.mktemp("ca") / "ca.crt"
    path.write_text(SYSTEM_CA.read_text() + f"\n# {CA_CANARY}\n")
    return path


@pytest.fixture(scope="session")
def cpu_image(
    engine: dict[str, str], ca_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The record of the CPU image built with `launcher build` (once per session)."""
    work = tmp_path_factory.mktemp("build")
    record = work / "record.json"
    proc = launcher(
        work, "build", "--variant", "cpu", "--base-image", engine["BASE_IMAGE"], "--tag", TAG,
        "--ca-bundle", str(ca_bundle), "--record", str(record),
        env={"DOCKER_HOST": engine["DOCKER_HOST"]}, timeout=2400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Step 1/" in proc.stderr, "the build's steps are shown as it goes"
    return dict(json.loads(record.read_text()))
