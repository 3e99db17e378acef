"""Data from the Hugging Face Hub's path without the Hub: an unreachable Hub fails fast with the fix,
the offline variables are honoured, a local dataset loads offline, and the embedded corpus stands in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_data import REPO_ROOT, copy_head, decode_docs, wikitext_docs
from trainer.data.corpus import DataSource, hub_reachable
from trainer.data.manifest import Manifest, load_manifest
from trainer.data.prepare import prepare_data

UNREACHABLE_HUB = "http://127.0.0.1:9"  # discard port on loopback: refused at once, no network needed


_HF_WORKER = """
import json, os, sys, time
from pathlib import Path

assert "datasets" not in sys.modules
from trainer.data.corpus import DataSource
from trainer.errors import DataError
from trainer.data.prepare import prepare_data

data_dir, dataset = Path(sys.argv[1]), sys.argv[2]
start = time.monotonic()
try:
    manifest = prepare_data(data_dir, DataSource(dataset=dataset), vocab_size=400, log=lambda _: None)
    result = {"manifest": manifest.model_dump()}
except DataError as e:
    result = {"error": str(e)}
result["seconds"] = time.monotonic() - start
import datasets, huggingface_hub.constants

# What the libraries read from the environment when they were imported, inside prepare_data.
result["offline_at_import"] = [
    datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
]
result["env"] = [os.environ.get("HF_HUB_OFFLINE"), os.environ.get("HF_DATASETS_OFFLINE")]
print("RESULT " + json.dumps(result))
"""


def load_with_hub_unreachable(dataset: str, data_dir: Path, tmp_path: Path) -> dict[str, Any]:
    """prepare_data of ``dataset`` in a fresh interpreter whose Hub probe is refused at once, with the
    offline variables unset and empty HF caches. Returns what _HF_WORKER reports."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env |= {
        "PYTHONPATH": str(REPO_ROOT),
        "HF_ENDPOINT": UNREACHABLE_HUB,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_DATASETS_CACHE": str(tmp_path / "hf-cache"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _HF_WORKER, str(data_dir), dataset],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_unreachable_hub_fails_fast_with_the_fix(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    result = load_with_hub_unreachable("wikitext", data_dir, tmp_path)
    message = result["error"]
    assert result["seconds"] < 5.0, f"took {result['seconds']:.1f} s"  # no retries against the Hub
    assert "unreachable" in message and "--text-files" in message and "HF_DATASETS_CACHE" in message
    assert not data_dir.exists()
    assert result["offline_at_import"] == [True, True] and result["env"] == ["1", "1"]


def test_hub_probe_honours_offline_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://10.255.255.1")  # would hang for the full timeout
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    start = time.monotonic()
    assert not hub_reachable()
    assert time.monotonic() - start < 0.5


@pytest.mark.parametrize("with_validation_file", [True, False])
def test_local_hf_dataset_loads_offline_while_hub_unreachable(
    with_validation_file: bool, wikitext_valid: Path, tmp_path: Path
) -> None:
    dataset_dir = tmp_path / "my_dataset"
    dataset_dir.mkdir()
    copy_head(wikitext_valid, dataset_dir / "train.txt", 300)
    if with_validation_file:
        (dataset_dir / "validation.txt").write_text(" = Held out = \n A held out paragraph .\n")
    data_dir = tmp_path / "data"
    result = load_with_hub_unreachable(str(dataset_dir), data_dir, tmp_path)
    # Offline mode was in the environment before `datasets` was imported, so the libraries took it.
    assert result["offline_at_import"] == [True, True] and result["env"] == ["1", "1"]
    manifest = Manifest.model_validate(result["manifest"])
    assert manifest.source_kind == "hf" and manifest == load_manifest(data_dir)
    val = decode_docs(data_dir, "val")
    if with_validation_file:
        assert val == [" = Held out = ", " A held out paragraph ."]
    else:  # carved: the tail of the train file
        assert val == wikitext_docs(dataset_dir / "train.txt")[-len(val) :]
        assert len(val) == manifest.documents["val"] >= 1


def test_auto_source_offline_uses_embedded_corpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pydoc_data.topics import topics

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    logs: list[str] = []
    data_dir = tmp_path / "data"
    manifest = prepare_data(data_dir, DataSource(), vocab_size=512, log=logs.append)
    assert manifest.source_kind == "embedded" and "pydoc_data.topics" in manifest.source
    notice = [line for line in logs if "pydoc_data.topics" in line and "--dataset wikitext" in line]
    assert len(notice) == 1 and "--text-files" in notice[0]
    first_doc = decode_docs(data_dir, "train")[0]
    assert first_doc in topics[sorted(topics)[0]]


# ---------------------------------------------------------------------------------- concurrency
