"""`launcher build` against a real Docker engine (`deploy/docker/dev-engine.sh up`): the CPU image is
built once per session from the offline Debian base; its record is compared with the probe run inside
it; the CA bundle given for the build must be in no layer of it; bad input fails with exit 2 and
leaves no container behind. The CUDA variant's pins are resolved by pip without downloading them.
Under CI=true a missing engine fails these tests instead of skipping them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from launcher.image.build import CONTEXT
from tests.integration.conftest import CA_CANARY, SYSTEM_CA, TAG, docker, launcher, run

pytestmark = pytest.mark.beside  # see conftest.pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[2]
EDITED = "gptlaunch-test:edited"


def test_recorded_versions_are_what_the_probe_finds_inside(
    engine: dict[str, str], cpu_image: dict[str, Any]
) -> None:
    inside = json.loads(
        docker(
            engine,
            "run",
            "--rm",
            "--network",
            "none",
            TAG,
            "python",
            "-m",
            "launcher.preflight.probe",
            "--json",
        )
    )
    versions = cpu_image["versions"]
    assert versions["torch"] == inside["torch"] and versions["torch"].endswith("+cpu")
    assert versions["python"] == inside["python"] and versions["torch_git"] == inside["torch_git"]
    assert versions["packages.tokenizers"] == inside["packages"]["tokenizers"] is not None
    assert versions["cuda"] is None and versions["nccl"] is None
    assert cpu_image["id"] == docker(engine, "image", "inspect", "--format", "{{.Id}}", TAG).strip()
    assert cpu_image["labels"]["io.gptlaunch.torch.version"] == inside["torch"]
    assert cpu_image["labels"]["io.gptlaunch.variant"] == "cpu"
    assert cpu_image["size_bytes"] > 0
    assert docker(engine, "run", "--rm", "--network", "none", TAG, "id", "-u").strip() != "0"


def test_torch_compile_works_in_the_image(engine: dict[str, str], cpu_image: dict[str, Any]) -> None:
    # the trainer compiles by default: Inductor builds C++ kernels, which needs g++ and Python.h
    code = "import torch; f = torch.compile(lambda x: x * 2 + 1); print(f(torch.arange(3.0)).tolist())"
    out = docker(engine, "run", "--rm", "--network", "none", TAG, "python", "-c", code)
    assert out.strip().splitlines()[-1] == "[1.0, 3.0, 5.0]"


def test_the_ca_bundle_is_in_no_layer(engine: dict[str, str], cpu_image: dict[str, Any]) -> None:
    # The saved image (~1.7 GB) is scanned as docker streams it: it never lands on the disk.
    env = {**os.environ, "DOCKER_HOST": engine["DOCKER_HOST"]}
    with subprocess.Popen(["docker", "image", "save", TAG], stdout=subprocess.PIPE, env=env) as save:
        assert save.stdout is not None
        stalled = threading.Timer(600, save.kill)  # a stalled engine fails the test instead of hanging it
        stalled.daemon = True
        stalled.start()
        previous, size = b"", 0
        while chunk := save.stdout.read(1 << 24):  # overlapping windows: the canary may straddle two reads
            assert CA_CANARY.encode() not in previous[-64:] + chunk
            previous, size = chunk, size + len(chunk)
    stalled.cancel()
    assert save.returncode == 0 and size > 100e6  # the layers were there to scan
    history = docker(engine, "history", "--no-trunc", TAG)
    assert CA_CANARY not in history and "ca.crt" not in history
    assert CA_CANARY not in docker(engine, "image", "inspect", TAG)


def test_a_code_edit_rebuilds_only_small_last_layers(
    engine: dict[str, str], cpu_image: dict[str, Any], ca_bundle: Path, tmp_path: Path
) -> None:
    checkout = tmp_path / "checkout"
    for name in CONTEXT:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        copy(ROOT / name, checkout / name)
    with (checkout / "launcher" / "__init__.py").open("a") as f:
        f.write("# an edit\n")
    proc = launcher(
        tmp_path, "build", "--variant", "cpu", "--base-image", engine["BASE_IMAGE"], "--tag", EDITED,
        "--ca-bundle", str(ca_bundle), "--context", str(checkout), "--record", str(tmp_path / "r.json"),
        env={"DOCKER_HOST": engine["DOCKER_HOST"]}, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = (
        json.loads(docker(engine, "image", "inspect", "--format", "{{json .RootFS.Layers}}", t))
        for t in (TAG, EDITED)
    )
    # Only the last two layers (our wheel copied in, then installed) differ: torch and the dependencies
    # before them are the very same layers.
    assert after[:-2] == before[:-2] and after[-2] != before[-2] and after[-1] != before[-1]
    rows = docker(
        engine, "history", "--no-trunc", "--human=false", "--format", "{{.Size}}\t{{.CreatedBy}}", EDITED
    )
    sizes = [int(row.split("\t", 1)[0]) for row in rows.splitlines() if "/tmp/dist" in row]
    assert len(sizes) == 2 and sum(sizes) < 5_000_000, rows[:2000]
    assert int(docker(engine, "image", "inspect", "--format", "{{.Size}}", EDITED)) > 100 * sum(sizes)


def test_a_failing_step_is_named_and_leaves_nothing_running(
    engine: dict[str, str], cpu_image: dict[str, Any], ca_bundle: Path, tmp_path: Path
) -> None:
    before = docker(engine, "ps", "--all", "--quiet")
    proc = launcher(
        tmp_path, "build", "--variant", "cpu", "--base-image", engine["BASE_IMAGE"],
        "--tag", "gptlaunch-test:broken",
        "--ca-bundle", str(ca_bundle), "--pip-index-url", "http://127.0.0.1:9/simple",
        env={"DOCKER_HOST": engine["DOCKER_HOST"]}, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr.split("launcher: error: ", 1)[-1]
    assert error.startswith("image build failed at Step ") and "pip install" in error.splitlines()[0]
    assert "Traceback" not in proc.stderr
    assert docker(engine, "ps", "--all", "--quiet") == before, "a failed build leaves no container"
    assert not docker(engine, "images", "--quiet", "gptlaunch-test:broken").strip()


def test_a_missing_base_image_is_named(engine: dict[str, str], tmp_path: Path) -> None:
    proc = launcher(
        tmp_path, "build", "--variant", "cpu", "--base-image", "gptlaunch-test/no-such-base:1",
        "--wheelhouse", str(tmp_path / "nowhere"), env={"DOCKER_HOST": engine["DOCKER_HOST"]},
    )  # fmt: skip
    assert proc.returncode == 2 and "holds no *.whl" in proc.stderr, proc.stderr[-2000:]
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "placeholder-0-py3-none-any.whl").write_bytes(b"")
    proc = launcher(
        tmp_path, "build", "--variant", "cpu", "--base-image", "gptlaunch-test/no-such-base:1",
        "--wheelhouse", str(tmp_path / "wheels"), env={"DOCKER_HOST": engine["DOCKER_HOST"]}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.split("launcher: error: ", 1)[-1]
    assert error.startswith("image build failed at Step ") and " : FROM " in error.splitlines()[0]
    assert "the base image gptlaunch-test/no-such-base:1 is neither in the engine nor pullable" in error
    assert "Traceback" not in proc.stderr


def test_an_unreachable_engine_is_a_clear_error(tmp_path: Path) -> None:
    proc = launcher(
        tmp_path, "build", "--variant", "cpu", env={"DOCKER_HOST": f"unix://{tmp_path}/none.sock"}
    )
    assert proc.returncode == 2
    assert "cannot reach the Docker engine at unix://" in proc.stderr and "DOCKER_HOST" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cuda_pins_resolve_to_themselves(tmp_path: Path) -> None:
    """pip's resolver, in --dry-run --report mode for the image's platform, takes the CUDA pins (and
    the NCCL build argument's default) under constraints.txt, as the Dockerfile does, to exactly the
    pinned set: metadata only, no GB of wheels."""
    pins = ROOT / "deploy" / "docker" / "pins" / "cuda.txt"
    nccl = next(
        line.split("=", 1)[1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("ARG NCCL_VERSION=")
    )
    report = tmp_path / "report.json"
    platforms = [a for minor in range(28, 16, -1) for a in ("--platform", f"manylinux_2_{minor}_x86_64")]
    proc = run(
        [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--report", str(report), "--only-binary", ":all:", *platforms,
            "--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64",
            "--python-version", "3.11", "--implementation", "cp", "--target", str(tmp_path / "nowhere"),
            "-c", str(ROOT / "constraints.txt"), "-r", str(pins), f"nvidia-nccl-cu13=={nccl}",
        ],
        env={"PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull, "PIP_CERT": str(SYSTEM_CA)},
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    pinned = dict(
        line.split("==", 1) for line in pins.read_text().splitlines() if line and not line.startswith("#")
    )
    assert resolved["torch"] == "2.13.0" and resolved["nvidia-nccl-cu13"] == nccl
    for name, pin in pinned.items():
        assert resolved.get(name.lower()) == pin, f"{name}=={pin} resolved to {resolved.get(name.lower())}"
    gpu_stack = {n for n in resolved if n.startswith(("nvidia-", "cuda-", "triton"))}
    assert gpu_stack <= {n.lower() for n in pinned} | {"nvidia-nccl-cu13"}, (
        "a GPU wheel torch needs is not pinned"
    )
