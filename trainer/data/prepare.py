"""Data preparation under a lock: tokenize a corpus into a data dir once, reuse it while it matches.

The data dir's format is in ``manifest``, text sources in ``corpus`` and the tokenizer in ``tokens``
(all in ``trainer.data``); this module decides whether prepared data can be reused and, if not,
prepares it, with one process at a time per data dir.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from gptlaunch.files import atomic_write
from trainer.data.corpus import Corpus, DataSource, load_corpus
from trainer.data.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    SPLITS,
    TOKENIZER_FILE,
    Manifest,
    file_problem,
    load_manifest,
    select_token_dtype,
)
from trainer.data.tokens import encode_to_file, eot_id, train_tokenizer
from trainer.errors import DataError

LOCK_FILE = ".prepare.lock"

Log = Callable[[str], None]


def prepare_data(
    data_dir: Path,
    source: DataSource,
    *,
    vocab_size: int = 8192,
    token_dtype: str = "auto",
    val_fraction: float = 0.05,
    log: Log = print,
) -> Manifest:
    """Make ``data_dir`` hold a tokenizer and train/val token files for ``source``; return the Manifest.

    Reuses the existing files when manifest.json's key matches the current inputs and settings and
    the files are intact; otherwise trains the tokenizer on the train split and encodes both splits.
    Safe to call from many processes at once: one prepares, the others wait and reuse.
    Raises DataError (before creating anything in ``data_dir``) for bad settings or unusable text.
    """
    data_dir = Path(data_dir)
    dtype = select_token_dtype(vocab_size, token_dtype)
    _check_val_fraction(val_fraction)
    if data_dir.exists() and not data_dir.is_dir():
        raise DataError(f"data dir {data_dir} exists and is not a directory; fix: pass another --data-dir")
    if source.text_files or source.dataset:
        corpus = load_corpus(source, val_fraction=val_fraction, log=log)  # errors before any write
        with _prepare_lock(data_dir, log):
            return _reuse_or_prepare(data_dir, corpus, vocab_size, dtype, val_fraction, log)
    # No source named: the data already prepared in data_dir is what is meant. Deciding under the lock
    # makes every rank agree, and only the first one probes the Hub for the automatic choice.
    with _prepare_lock(data_dir, log):
        manifest = _intact_manifest(data_dir)
        if manifest is not None and (manifest.requested_vocab_size, manifest.dtype) == (vocab_size, dtype):
            log(f"data: using the prepared data in {data_dir} ({manifest.summary()})")
            return manifest
        corpus = load_corpus(source, val_fraction=val_fraction, log=log)
        return _reuse_or_prepare(data_dir, corpus, vocab_size, dtype, val_fraction, log)


def _reuse_or_prepare(
    data_dir: Path, corpus: Corpus, vocab_size: int, dtype: str, val_fraction: float, log: Log
) -> Manifest:
    """With the prepare lock held: the manifest of reusable data, else of freshly prepared data."""
    key = _reuse_key(corpus, vocab_size, dtype, val_fraction)
    problem = _reuse_problem(data_dir, key, corpus, vocab_size, dtype, val_fraction)
    if problem is None:
        manifest = load_manifest(data_dir)
        log(f"data: reusing prepared data in {data_dir} ({manifest.summary()})")
        return manifest
    log(f"data: preparing {data_dir} from {corpus.description}: {problem}")
    return _prepare(data_dir, corpus, key, vocab_size, dtype, val_fraction, log)


def _intact_manifest(data_dir: Path) -> Manifest | None:
    """The manifest of data_dir when it and every file it names are intact, else None."""
    try:
        manifest = load_manifest(data_dir)
    except DataError:
        return None
    return None if _files_problem(data_dir, manifest) else manifest


# ------------------------------------------------------------------------------------- preparing


def _prepare(
    data_dir: Path,
    corpus: Corpus,
    key: str,
    vocab_size: int,
    dtype: str,
    val_fraction: float,
    log: Log,
) -> Manifest:
    # Drop the old manifest first: if we crash below, no manifest describes a mix of old/new files.
    (data_dir / MANIFEST_FILE).unlink(missing_ok=True)
    for stale in data_dir.glob(".*.tmp"):  # left by a crashed preparer (atomic_write); we hold the lock
        stale.unlink(missing_ok=True)
    log(f"data: training byte-level BPE tokenizer (vocab {vocab_size}) on {len(corpus.train):,} documents")
    tokenizer = train_tokenizer(corpus.train, vocab_size)
    tokenizer_bytes = tokenizer.to_str().encode()
    with atomic_write(data_dir / TOKENIZER_FILE) as f:
        f.write(tokenizer_bytes)
    eot = eot_id(tokenizer)
    docs = {"train": corpus.train, "val": corpus.val}
    tokens = {s: encode_to_file(tokenizer, docs[s], eot, dtype, data_dir / f"{s}.bin") for s in SPLITS}
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        key=key,
        source=corpus.description,
        source_kind=corpus.kind,
        source_identity=corpus.identity,
        vocab_size=tokenizer.get_vocab_size(),
        requested_vocab_size=vocab_size,
        dtype=dtype,
        eot_id=eot,
        splits=tokens,
        documents={s: len(docs[s]) for s in SPLITS},
        input_sha256=corpus.input_sha256,
        tokenizer_sha256=hashlib.sha256(tokenizer_bytes).hexdigest(),
        val_fraction=val_fraction,
    )
    with atomic_write(data_dir / MANIFEST_FILE) as f:
        f.write(json.dumps(manifest.model_dump(), indent=2, sort_keys=True).encode() + b"\n")
    log(f"data: wrote {data_dir} ({manifest.summary()})")
    return manifest


# ------------------------------------------------------------------------------------------ reuse


def _reuse_key(corpus: Corpus, vocab_size: int, dtype: str, val_fraction: float) -> str:
    fields = {
        "format_version": FORMAT_VERSION,
        "source_identity": corpus.identity,
        "input_sha256": corpus.input_sha256,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "val_fraction": val_fraction,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _reuse_problem(
    data_dir: Path, key: str, corpus: Corpus, vocab_size: int, dtype: str, val_fraction: float
) -> str | None:
    """Why the prepared data in ``data_dir`` cannot be reused, or None when it can."""
    if not (data_dir / MANIFEST_FILE).exists():
        return f"no {MANIFEST_FILE} yet"
    try:
        manifest = load_manifest(data_dir)
    except DataError as e:
        return f"existing manifest unusable ({e})"
    if manifest.key != key:
        return _what_changed(manifest, corpus, vocab_size, dtype, val_fraction)
    return _files_problem(data_dir, manifest)


def _files_problem(data_dir: Path, manifest: Manifest) -> str | None:
    """What is wrong with the files ``manifest`` names, or None when they are intact."""
    for name, size in manifest.file_sizes().items():
        problem = file_problem(data_dir / name, size)
        if problem is not None:
            return problem
    tokenizer_path = data_dir / TOKENIZER_FILE
    if not tokenizer_path.is_file() or _sha256_file(tokenizer_path) != manifest.tokenizer_sha256:
        return f"{TOKENIZER_FILE} is missing or does not match the manifest"
    return None


def _what_changed(old: Manifest, corpus: Corpus, vocab_size: int, dtype: str, val_fraction: float) -> str:
    changes = [
        (old.source_identity != corpus.identity, f"source changed ({old.source} -> {corpus.description})"),
        (old.input_sha256 != corpus.input_sha256, "input text changed"),
        (old.requested_vocab_size != vocab_size, f"vocab size {old.requested_vocab_size} -> {vocab_size}"),
        (old.dtype != dtype, f"token dtype {old.dtype} -> {dtype}"),
        (old.val_fraction != val_fraction, f"val fraction {old.val_fraction} -> {val_fraction}"),
    ]
    reasons = [text for changed, text in changes if changed]
    return "; ".join(reasons) if reasons else "preparation settings changed"


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # only tokenizer.json: small


# ------------------------------------------------------------------------------------- file system


def _check_val_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction {val_fraction} must be between 0 and 1 (exclusive); fix: e.g. 0.05")


@contextlib.contextmanager
def _prepare_lock(data_dir: Path, log: Log) -> Iterator[None]:
    """Hold ``data_dir/.prepare.lock`` (creating data_dir); say so when another process has it."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(data_dir / LOCK_FILE))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log(f"data: another process is preparing {data_dir}; waiting for it")
            lock.acquire()
    except OSError as e:
        raise DataError(f"cannot write to data dir {data_dir} ({e}); fix: pass a writable --data-dir") from e
    try:
        yield
    finally:
        lock.release()
