"""Data preparation on real text (WikiText-2 validation split, Python's pydoc topics)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer.data.corpus import DataSource
from trainer.data.manifest import EOT_TOKEN, Manifest, load_manifest, select_token_dtype
from trainer.data.prepare import prepare_data
from trainer.data.splits import load_tokenizer, open_split
from trainer.errors import DataError

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFEST_KEYS = [
    "format_version",
    "key",
    "source",
    "source_kind",
    "source_identity",
    "vocab_size",
    "requested_vocab_size",
    "dtype",
    "eot_id",
    "splits",
    "documents",
    "input_sha256",
    "tokenizer_sha256",
    "val_fraction",
]


def wikitext_docs(path: Path) -> list[str]:
    """The file's documents as the module defines them: non-blank lines without their terminator."""
    return [line.rstrip("\r") for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def decode_docs(data_dir: Path, split: str) -> list[str]:
    """Decode a whole token file and cut it at every EOT: the documents it holds."""
    text = load_tokenizer(data_dir).decode(open_split(data_dir, split).tolist(), skip_special_tokens=False)
    assert text.endswith(EOT_TOKEN)
    return text.split(EOT_TOKEN)[:-1]


def copy_head(src: Path, dst: Path, lines: int) -> Path:
    dst.write_text(
        "".join(src.read_text(encoding="utf-8").splitlines(keepends=True)[:lines]), encoding="utf-8"
    )
    return dst


@pytest.fixture(scope="module")
def wikitext_prepared(
    wikitext_valid: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Manifest]:
    data_dir = tmp_path_factory.mktemp("wikitext") / "data"
    source = DataSource(text_files=(str(wikitext_valid),))
    manifest = prepare_data(data_dir, source, vocab_size=1024, log=lambda _: None)
    return data_dir, manifest


# ------------------------------------------------------------------------------ dtype selection


@pytest.mark.parametrize(
    ("vocab", "requested", "expected"),
    [
        (257, "auto", "uint16"),
        (8192, "auto", "uint16"),
        (65536, "auto", "uint16"),
        (65537, "auto", "uint32"),
        (2**32, "auto", "uint32"),
        (8192, "uint32", "uint32"),
        (65536, "uint16", "uint16"),
    ],
)
def test_select_token_dtype(vocab: int, requested: str, expected: str) -> None:
    assert select_token_dtype(vocab, requested) == expected


@pytest.mark.parametrize(
    ("vocab", "requested", "named"),
    [
        (256, "auto", "--vocab-size"),
        (2**32 + 1, "auto", "--vocab-size"),
        (65537, "uint16", "--token-dtype uint32"),
        (8192, "int8", "--token-dtype"),
    ],
)
def test_select_token_dtype_rejects(vocab: int, requested: str, named: str) -> None:
    with pytest.raises(DataError, match="fix:") as excinfo:
        select_token_dtype(vocab, requested)
    assert named in str(excinfo.value)


# ------------------------------------------------------------------------------- prepared text


def test_manifest_describes_the_files(wikitext_valid: Path, wikitext_prepared: tuple[Path, Manifest]) -> None:
    data_dir, manifest = wikitext_prepared
    tokenizer = load_tokenizer(data_dir)
    assert load_manifest(data_dir) == manifest
    assert str(wikitext_valid.resolve()) in manifest.source  # paths are recorded resolved
    assert manifest.vocab_size == tokenizer.get_vocab_size() <= 1024
    assert manifest.dtype == "uint16"
    assert manifest.eot_id == tokenizer.token_to_id(EOT_TOKEN)
    assert manifest.splits["train"] > 100_000 and manifest.splits["val"] > 1_000
    tokenizer_bytes = (data_dir / "tokenizer.json").read_bytes()
    assert manifest.tokenizer_sha256 == hashlib.sha256(tokenizer_bytes).hexdigest()
    assert len(manifest.input_sha256) == len(manifest.key) == 64
    for split, n_tokens in manifest.splits.items():
        assert (data_dir / f"{split}.bin").stat().st_size == 2 * n_tokens
    on_disk = json.loads((data_dir / "manifest.json").read_text())
    assert on_disk == manifest.model_dump()
    assert sorted(on_disk) == sorted(MANIFEST_KEYS)  # the file's form: older data dirs stay readable


def test_train_tokens_decode_to_the_start_of_the_text(
    wikitext_valid: Path, wikitext_prepared: tuple[Path, Manifest]
) -> None:
    data_dir, _ = wikitext_prepared
    tokens = open_split(data_dir, "train")
    text = load_tokenizer(data_dir).decode(tokens[:100].tolist(), skip_special_tokens=False)
    stream = "".join(doc + EOT_TOKEN for doc in wikitext_docs(wikitext_valid)[:100])
    assert len(text) > 200
    assert stream.startswith(text)
    assert text.startswith(" = Homarus gammarus = " + EOT_TOKEN)


def test_splits_partition_the_documents(
    wikitext_valid: Path, wikitext_prepared: tuple[Path, Manifest]
) -> None:
    data_dir, manifest = wikitext_prepared
    docs = wikitext_docs(wikitext_valid)
    train, val = decode_docs(data_dir, "train"), decode_docs(data_dir, "val")
    assert len(val) == manifest.documents["val"] == round(0.05 * len(docs))
    assert len(train) == manifest.documents["train"] == len(docs) - len(val)
    assert train + val == docs  # every document exactly once, val the contiguous tail


def test_open_split_is_a_read_only_flat_array(wikitext_prepared: tuple[Path, Manifest]) -> None:
    data_dir, manifest = wikitext_prepared
    val = open_split(data_dir, "val")
    assert val.ndim == 1 and val.dtype == np.uint16 and len(val) == manifest.splits["val"]
    assert not val.flags.writeable
    assert int(val.max()) < manifest.vocab_size
    assert int(np.count_nonzero(val == manifest.eot_id)) == manifest.documents["val"]
    with pytest.raises(DataError, match="unknown split"):
        open_split(data_dir, "test")


# --------------------------------------------------------------------------- reuse / re-prepare


def test_reuses_and_reprepares_when_inputs_change(wikitext_valid: Path, tmp_path: Path) -> None:
    text = copy_head(wikitext_valid, tmp_path / "text.txt", 400)
    data_dir, logs = tmp_path / "data", []
    source = DataSource(text_files=(str(text),))
    first = prepare_data(data_dir, source, vocab_size=512, log=logs.append)
    mtime = (data_dir / "tokenizer.json").stat().st_mtime_ns

    logs.clear()
    assert prepare_data(data_dir, source, vocab_size=512, log=logs.append) == first
    assert any("reusing prepared data in" in line for line in logs)
    assert not any("training" in line for line in logs)
    assert (data_dir / "tokenizer.json").stat().st_mtime_ns == mtime

    with text.open("a", encoding="utf-8") as f:
        f.write(" A new paragraph about the European lobster .\n")
    logs.clear()
    changed = prepare_data(data_dir, source, vocab_size=512, log=logs.append)
    assert any("input text changed" in line for line in logs)
    assert any("training" in line for line in logs)
    assert changed.input_sha256 != first.input_sha256 and changed.key != first.key
    assert decode_docs(data_dir, "val")[-1] == " A new paragraph about the European lobster ."

    logs.clear()
    prepare_data(data_dir, source, vocab_size=600, log=logs.append)
    assert any("vocab size 512 -> 600" in line for line in logs)


def test_reprepares_damaged_data(wikitext_valid: Path, tmp_path: Path) -> None:
    text = copy_head(wikitext_valid, tmp_path / "text.txt", 200)
    data_dir, logs = tmp_path / "data", []
    source = DataSource(text_files=(str(text),))
    manifest = prepare_data(data_dir, source, vocab_size=300, log=logs.append)

    with (data_dir / "train.bin").open("r+b") as f:  # a half-written file from an outside cause
        f.truncate(10)
    with pytest.raises(DataError, match=r"train\.bin has 10 bytes"):
        open_split(data_dir, "train")
    logs.clear()
    assert prepare_data(data_dir, source, vocab_size=300, log=logs.append) == manifest
    assert any("train.bin has 10 bytes" in line for line in logs)

    (data_dir / "manifest.json").write_text('{"key": ')
    with pytest.raises(DataError, match="corrupt"):
        load_manifest(data_dir)
    logs.clear()
    assert prepare_data(data_dir, source, vocab_size=300, log=logs.append) == manifest
    assert any("existing manifest unusable" in line for line in logs)
    assert [p.name for p in data_dir.iterdir() if p.name.endswith(".tmp")] == []


# ----------------------------------------------------------------------------- validation errors


def _bad_inputs(tmp_path: Path, wikitext_valid: Path) -> dict[str, tuple[DataSource, dict[str, Any], str]]:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\t\n\n")
    one_line = tmp_path / "one.txt"
    one_line.write_text(" = Homarus gammarus = \n")
    good = (str(wikitext_valid),)
    return {
        "missing file": (DataSource(text_files=(str(tmp_path / "nope.txt"),)), {}, "not found"),
        "glob matches nothing": (DataSource(text_files=(str(tmp_path / "*.md"),)), {}, "matched no files"),
        "empty file": (DataSource(text_files=(str(empty),)), {}, "empty"),
        "whitespace-only file": (DataSource(text_files=(str(blank),)), {}, "empty"),
        "too small to split": (DataSource(text_files=(str(one_line),)), {}, "at least 2"),
        "vocab too big for dtype": (
            DataSource(text_files=good),
            {"vocab_size": 70_000, "token_dtype": "uint16"},
            "--token-dtype uint32",
        ),
        "vocab too small": (DataSource(text_files=good), {"vocab_size": 100}, "--vocab-size"),
        "both sources": (DataSource(dataset="wikitext", text_files=good), {}, "only one"),
        "bad val fraction": (DataSource(text_files=good), {"val_fraction": 1.0}, "val_fraction"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing file",
        "glob matches nothing",
        "empty file",
        "whitespace-only file",
        "too small to split",
        "vocab too big for dtype",
        "vocab too small",
        "both sources",
        "bad val fraction",
    ],
)
def test_bad_input_raises_and_writes_nothing(case: str, tmp_path: Path, wikitext_valid: Path) -> None:
    source, kwargs, expected = _bad_inputs(tmp_path, wikitext_valid)[case]
    data_dir = tmp_path / "data"
    with pytest.raises(DataError) as excinfo:
        prepare_data(data_dir, source, log=lambda _: None, **kwargs)
    assert expected in str(excinfo.value) and "fix:" in str(excinfo.value)
    assert not data_dir.exists()


# ---------------------------------------------------------------------------- hub and fallback


# Loads of a Hugging Face dataset run in a fresh interpreter: offline mode is decided before
# `datasets` is imported (it reads HF_HUB_OFFLINE / HF_DATASETS_OFFLINE once, at import), so the test
# process, where another test may have imported it, cannot show it.


_WORKER = """
import json, sys, time
from pathlib import Path
from trainer.data.corpus import DataSource
from trainer.data.prepare import prepare_data

data_dir, text, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
while not go.exists():  # start line: every worker reaches prepare_data at the same moment
    time.sleep(0.01)
manifest = prepare_data(data_dir, DataSource(text_files=(text,)), vocab_size=512)
print("MANIFEST " + json.dumps(manifest.model_dump(), sort_keys=True))
"""


def test_concurrent_processes_prepare_once(wikitext_valid: Path, tmp_path: Path) -> None:
    data_dir, go = tmp_path / "data", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", _WORKER, str(data_dir), str(wikitext_valid), str(go)]
    workers = [
        subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    time.sleep(1.0)  # let the interpreters start and import
    go.touch()
    outputs = [w.communicate(timeout=60) for w in workers]
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err
    stdout = "".join(out for out, _ in outputs)
    assert stdout.count("training byte-level BPE tokenizer") == 1
    assert stdout.count("reusing prepared data in") == 2
    manifests = [line for line in stdout.splitlines() if line.startswith("MANIFEST ")]
    assert len(manifests) == 3 and len(set(manifests)) == 1
    assert json.loads(manifests[0].removeprefix("MANIFEST ")) == load_manifest(data_dir).model_dump()
