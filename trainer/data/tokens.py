"""Tokenization: train a byte-level BPE tokenizer and encode documents into a flat token file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gptlaunch.files import atomic_write
from trainer.data.manifest import EOT_TOKEN

ENCODE_BATCH_DOCS = 8192  # documents per encode_batch call: parallel in Rust, bounded memory here


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


def eot_id(tokenizer: Tokenizer) -> int:
    """The id of ``<|endoftext|>`` in a tokenizer made by ``train_tokenizer``."""
    found = tokenizer.token_to_id(EOT_TOKEN)
    if found is None:  # cannot happen: the trainer always adds its special tokens
        raise RuntimeError(f"trained tokenizer lacks {EOT_TOKEN}")
    return int(found)


def encode_to_file(tokenizer: Tokenizer, docs: Sequence[str], eot: int, dtype: str, path: Path) -> int:
    """Write, atomically, every document's ids followed by ``eot`` to ``path`` as a flat array of
    ``dtype`` ("uint16" or "uint32"). Returns the number of tokens written. Raises OSError when the
    write fails (``path`` is then left as it was)."""
    count = 0
    with atomic_write(path) as f:
        for start in range(0, len(docs), ENCODE_BATCH_DOCS):
            batch = tokenizer.encode_batch(
                list(docs[start : start + ENCODE_BATCH_DOCS]), add_special_tokens=False
            )
            ids: list[int] = []
            for encoding in batch:
                ids.extend(encoding.ids)
                ids.append(eot)
            chunk = np.asarray(ids, dtype=dtype)
            chunk.tofile(f)
            count += chunk.size
    return count
