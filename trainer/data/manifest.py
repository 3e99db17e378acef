"""The format of a prepared data directory: its layout, ``manifest.json`` and the token dtype.

Layout of a prepared ``data_dir``::

    tokenizer.json   HF tokenizers file (byte-level BPE, special token <|endoftext|>)
    train.bin        raw 1-D array of token ids (uint16 or uint32, native byte order), each document + EOT
    val.bin          same, for the validation documents
    manifest.json    written last; describes the files above (see Manifest)
    .prepare.lock    serialises concurrent preparers (see trainer.data.prepare)

This module imports no torch, numpy or tokenizers: launchers use ``select_token_dtype`` to check
arguments.
"""

from __future__ import annotations

from pathlib import Path

import pydantic

from trainer.errors import DataError

FORMAT_VERSION = 1  # bump when the files' meaning changes: old data dirs are then re-prepared
EOT_TOKEN = "<|endoftext|>"
SPLITS = ("train", "val")
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
MIN_VOCAB = 257  # 256 byte tokens + <|endoftext|>
MAX_VOCAB = 2**32  # ids must fit uint32
TOKEN_DTYPES = ("auto", "uint16", "uint32")
DTYPE_BYTES = {"uint16": 2, "uint32": 4}


class Manifest(pydantic.BaseModel):
    """What ``prepare_data`` wrote to a data dir (``manifest.json``, one key per field)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

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
        return {f"{split}.bin": n * DTYPE_BYTES[self.dtype] for split, n in self.splits.items()}

    def summary(self) -> str:
        """One line for logs: source, tokens per split, vocab and dtype."""
        tokens = ", ".join(f"{split} {n:,} tokens" for split, n in self.splits.items())
        return f"{self.source}; {tokens}; vocab {self.vocab_size}, {self.dtype}"


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
        manifest = Manifest.model_validate_json(raw, strict=True)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "file"
        raise DataError(f"{path} is corrupt ({where}: {first['msg']}); {fix}") from e
    if manifest.format_version != FORMAT_VERSION:
        raise DataError(f"{path} has format {manifest.format_version}, expected {FORMAT_VERSION}; {fix}")
    if manifest.dtype not in DTYPE_BYTES or set(manifest.splits) != set(SPLITS):
        raise DataError(
            f"{path} is corrupt (dtype {manifest.dtype!r}, splits {sorted(manifest.splits)}); {fix}"
        )
    return manifest


def file_problem(path: Path, expected_bytes: int) -> str | None:
    """What is wrong with the file ``path`` that should hold ``expected_bytes`` bytes, or None."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path.name} is missing"
    if size != expected_bytes:
        return f"{path.name} has {size} bytes, the manifest says {expected_bytes}"
    return None


def select_token_dtype(vocab_size: int, token_dtype: str = "auto") -> str:
    """The dtype name ("uint16" or "uint32") for token files of a ``vocab_size`` vocabulary.

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
