"""Data preparation: train a byte-level BPE tokenizer and write flat token files, once per data dir.

Layout of a prepared ``data_dir``::

    tokenizer.json   HF tokenizers file (byte-level BPE, special token <|endoftext|>)
    train.bin        raw 1-D numpy array of token ids (uint16 or uint32), each document + EOT
    val.bin          same, for the validation documents
    manifest.json    written last; describes the files above (see Manifest)
    .prepare.lock    serialises concurrent preparers (torchrun ranks, several nodes on one file system)

Text sources live in ``trainer.corpus``; this module only turns a corpus into tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pydantic
from filelock import FileLock, Timeout
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.corpus import Corpus, DataError, DataSource, empty_file_error, expand_text_files, load_corpus
from trainer.fsutil import atomic_write

__all__ = [
    "EOT_TOKEN",
    "FORMAT_VERSION",
    "DataError",
    "DataSource",
    "Manifest",
    "load_manifest",
    "load_tokenizer",
    "open_split",
    "prepare_data",
    "select_token_dtype",
]

FORMAT_VERSION = 1  # bump when the files' meaning changes: old data dirs are then re-prepared
EOT_TOKEN = "<|endoftext|>"
SPLITS = ("train", "val")
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
LOCK_FILE = ".prepare.lock"
MIN_VOCAB = 257  # 256 byte tokens + <|endoftext|>
MAX_VOCAB = 2**32  # ids must fit uint32
TOKEN_DTYPES = ("auto", "uint16", "uint32")
ENCODE_BATCH_DOCS = 8192  # documents per encode_batch call: parallel in Rust, bounded memory here


@dataclass(frozen=True)
class Manifest:
    """What ``prepare_data`` wrote to a data dir (``manifest.json``)."""

    format_version: int
    key: str  # hash of source identity, input sha256, vocab size, dtype, val fraction, format version
    source: str  # human description of the text source
    source_kind: str  # "hf", "text-files" or "embedded"
    source_identity: str
    vocab_size: int  # the trained tokenizer's actual vocab size (<= requested_vocab_size)
    requested_vocab_size: int
    dtype: str  # "uint16" or "uint32": element type of train.bin / val.bin
    eot_id: int  # id of <|endoftext|>, appended after every document
    splits: dict[str, int]  # split -> number of tokens in <split>.bin
    documents: dict[str, int]  # split -> number of documents
    input_sha256: str
    tokenizer_sha256: str  # sha256 of tokenizer.json's bytes
    val_fraction: float

    def file_sizes(self) -> dict[str, int]:
        """Expected size in bytes of each token file, by file name."""
        itemsize = np.dtype(self.dtype).itemsize
        return {f"{split}.bin": n * itemsize for split, n in self.splits.items()}


_MANIFEST_ADAPTER = pydantic.TypeAdapter(Manifest)


# ------------------------------------------------------------------------------------- public API


def select_token_dtype(vocab_size: int, token_dtype: str = "auto") -> str:
    """The numpy dtype name ("uint16" or "uint32") for token files of a ``vocab_size`` vocabulary.

    "auto" picks uint16 when every id fits (vocab_size <= 65536), else uint32. Raises DataError when
    vocab_size is outside [257, 2**32], token_dtype is unknown, or uint16 is asked for a larger vocab.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise DataError(f"--vocab-size must be an integer, got {vocab_size!r}; fix: e.g. --vocab-size 8192")
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(
            f"--vocab-size {vocab_size} is out of range: byte-level BPE needs at least {MIN_VOCAB} "
            f"(256 bytes + {EOT_TOKEN}) and token files hold at most 2**32 ids; "
            f"fix: pass --vocab-size between {MIN_VOCAB} and {MAX_VOCAB} (e.g. 8192)"
        )
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(
            f"--token-dtype {token_dtype!r} is unknown; fix: use one of {', '.join(TOKEN_DTYPES)}"
        )
    needed = "uint16" if vocab_size <= 2**16 else "uint32"
    if token_dtype == "uint16" and needed == "uint32":
        raise DataError(
            f"--vocab-size {vocab_size} does not fit --token-dtype uint16 (at most 65536 ids); "
            "fix: use --token-dtype uint32 (or auto), or --vocab-size 65536 or less"
        )
    return needed if token_dtype == "auto" else token_dtype


def prepare_data(
    data_dir: Path,
    source: DataSource,
    *,
    vocab_size: int = 8192,
    token_dtype: str = "auto",
    val_fraction: float = 0.05,
    log: Callable[[str], None] = print,
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
            log(f"data: using the prepared data in {data_dir} ({_summary(manifest)})")
            return manifest
        corpus = load_corpus(source, val_fraction=val_fraction, log=log)
        return _reuse_or_prepare(data_dir, corpus, vocab_size, dtype, val_fraction, log)


def _reuse_or_prepare(
    data_dir: Path,
    corpus: Corpus,
    vocab_size: int,
    dtype: str,
    val_fraction: float,
    log: Callable[[str], None],
) -> Manifest:
    """With the prepare lock held: the manifest of reusable data, else of freshly prepared data."""
    key = _reuse_key(corpus, vocab_size, dtype, val_fraction)
    problem = _reuse_problem(data_dir, key, corpus, vocab_size, dtype, val_fraction)
    if problem is None:
        manifest = load_manifest(data_dir)
        log(f"data: reusing prepared data in {data_dir} ({_summary(manifest)})")
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


def load_manifest(data_dir: Path) -> Manifest:
    """Read ``data_dir/manifest.json``.

    Raises DataError when it is missing, unreadable, corrupt, or of another FORMAT_VERSION.
    """
    path = Path(data_dir) / MANIFEST_FILE
    fix = f"fix: delete {data_dir} and prepare the data again"
    try:
        raw = path.read_bytes()
    except FileNotFoundError as e:
        raise DataError(
            f"no prepared data in {data_dir} ({MANIFEST_FILE} missing); fix: prepare it first"
        ) from e
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror}); fix: check its permissions") from e
    try:
        manifest = _MANIFEST_ADAPTER.validate_json(raw, strict=True)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "file"
        raise DataError(f"{path} is corrupt ({where}: {first['msg']}); {fix}") from e
    if manifest.format_version != FORMAT_VERSION:
        raise DataError(f"{path} has format {manifest.format_version}, expected {FORMAT_VERSION}; {fix}")
    if manifest.dtype not in ("uint16", "uint32") or set(manifest.splits) != set(SPLITS):
        raise DataError(
            f"{path} is corrupt (dtype {manifest.dtype!r}, splits {sorted(manifest.splits)}); {fix}"
        )
    return manifest


def open_split(data_dir: Path, split: str) -> np.memmap:
    """Memory-map ``data_dir/<split>.bin`` read-only.

    Returns a 1-D array of token ids (dtype from the manifest, uint16 or uint32); length = the number
    of tokens of that split. Raises DataError for an unknown split, or a missing or wrongly sized
    file or manifest.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; fix: use one of {', '.join(SPLITS)}")
    manifest = load_manifest(data_dir)
    path = Path(data_dir) / f"{split}.bin"
    problem = _file_problem(path, manifest.file_sizes()[path.name])
    if problem is not None:
        raise DataError(f"{problem}; fix: delete {data_dir} and prepare the data again")
    return np.memmap(path, dtype=manifest.dtype, mode="r", shape=(manifest.splits[split],))


def load_tokenizer(data_dir: Path) -> Tokenizer:
    """Load ``data_dir/tokenizer.json``, checked against the manifest's sha256.

    Raises DataError when the manifest or tokenizer is missing, or the tokenizer does not match.
    """
    manifest = load_manifest(data_dir)
    path = Path(data_dir) / TOKENIZER_FILE
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror}); fix: delete {data_dir} and prepare again") from e
    if hashlib.sha256(raw).hexdigest() != manifest.tokenizer_sha256:
        raise DataError(f"{path} does not match the manifest; fix: delete {data_dir} and prepare again")
    return Tokenizer.from_str(raw.decode())


# ------------------------------------------------------------------------------------- preparing


def _prepare(
    data_dir: Path,
    corpus: Corpus,
    key: str,
    vocab_size: int,
    dtype: str,
    val_fraction: float,
    log: Callable[[str], None],
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
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    if eot_id is None:  # cannot happen: the trainer always adds its special tokens
        raise RuntimeError(f"trained tokenizer lacks {EOT_TOKEN}")
    docs = {"train": corpus.train, "val": corpus.val}
    tokens = {s: _encode_split(tokenizer, docs[s], eot_id, dtype, data_dir / f"{s}.bin") for s in SPLITS}
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        key=key,
        source=corpus.description,
        source_kind=corpus.kind,
        source_identity=corpus.identity,
        vocab_size=tokenizer.get_vocab_size(),
        requested_vocab_size=vocab_size,
        dtype=dtype,
        eot_id=eot_id,
        splits=tokens,
        documents={s: len(docs[s]) for s in SPLITS},
        input_sha256=corpus.input_sha256,
        tokenizer_sha256=hashlib.sha256(tokenizer_bytes).hexdigest(),
        val_fraction=val_fraction,
    )
    with atomic_write(data_dir / MANIFEST_FILE) as f:
        f.write(json.dumps(asdict(manifest), indent=2, sort_keys=True).encode() + b"\n")
    log(f"data: wrote {data_dir} ({_summary(manifest)})")
    return manifest


def train_tokenizer(docs: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``docs``; ``<|endoftext|>`` is its only special token.

    Its vocab size is at most ``vocab_size`` (less when the text has too few distinct merges).
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no <unk>
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tokenizer


def _encode_split(tokenizer: Tokenizer, docs: Sequence[str], eot_id: int, dtype: str, path: Path) -> int:
    """Write every document's ids followed by ``eot_id`` to ``path``; return the number of tokens."""
    count = 0
    with atomic_write(path) as f:
        for start in range(0, len(docs), ENCODE_BATCH_DOCS):
            batch = tokenizer.encode_batch(
                list(docs[start : start + ENCODE_BATCH_DOCS]), add_special_tokens=False
            )
            ids: list[int] = []
            for encoding in batch:
                ids.extend(encoding.ids)
                ids.append(eot_id)
            chunk = np.asarray(ids, dtype=dtype)
            chunk.tofile(f)
            count += chunk.size
    return count


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
        problem = _file_problem(data_dir / name, size)
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


def _file_problem(path: Path, expected_bytes: int) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path.name} is missing"
    if size != expected_bytes:
        return f"{path.name} has {size} bytes, the manifest says {expected_bytes}"
    return None


def _summary(manifest: Manifest) -> str:
    tokens = ", ".join(f"{split} {n:,} tokens" for split, n in manifest.splits.items())
    return f"{manifest.source}; {tokens}; vocab {manifest.vocab_size}, {manifest.dtype}"


# ------------------------------------------------------------------------------------- file system


def _check_val_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction {val_fraction} must be between 0 and 1 (exclusive); fix: e.g. 0.05")


@contextlib.contextmanager
def _prepare_lock(data_dir: Path, log: Callable[[str], None]) -> Iterator[None]:
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


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # only tokenizer.json: small


def check_source(source: DataSource, *, vocab_size: int = 8192, token_dtype: str = "auto") -> None:
    """Cheap up-front check of what ``prepare_data`` would reject, for launchers: the vocab/dtype
    pair, and that every text file exists and holds some non-blank text (read only until the first
    non-blank character, so a large corpus costs little). Raises DataError; writes nothing."""
    select_token_dtype(vocab_size, token_dtype)
    if not source.text_files:
        return
    for path in expand_text_files(source.text_files):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 16):
                if chunk.strip():
                    break
            else:
                raise empty_file_error(path)
