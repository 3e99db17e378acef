"""Reading prepared data: the token files as arrays and the tokenizer they were made with.

The data dir's format is in ``trainer.data.manifest``; ``trainer.data.prepare`` writes it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from trainer.data.manifest import SPLITS, TOKENIZER_FILE, file_problem, load_manifest
from trainer.errors import DataError


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
    problem = file_problem(path, manifest.file_sizes()[path.name])
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
