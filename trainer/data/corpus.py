"""Text sources for data preparation: a Hugging Face dataset, local text files, or an embedded corpus.

Every source becomes a :class:`Corpus`: train and validation documents (one string each, without its
line terminator) plus a path-independent identity and a sha256 of the input, which ``prepare`` folds
into the key that decides whether prepared token files can be reused. Imports no torch, numpy or
tokenizers (``trainer.precheck`` expands ``--text-files`` with it).
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import DataError

DEFAULT_DATASET = "wikitext"
DEFAULT_WIKITEXT_CONFIG = "wikitext-2-raw-v1"
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
HUB_PROBE_TIMEOUT_S = 3.0
# The HF libraries' documented offline switches. They read them once, when first imported.
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE_VALUES = {"1", "true", "yes", "on"}
_FIX_OWN_TEXT = "--text-files PATH... (one document per line)"


@dataclass(frozen=True)
class DataSource:
    """Where the text comes from. Neither ``dataset`` nor ``text_files``: auto (see ``load_corpus``)."""

    dataset: str | None = None
    dataset_config: str | None = None
    text_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class Corpus:
    """Documents of one source, already split into train and validation."""

    description: str  # for humans: logs and the manifest
    kind: str  # "hf", "text-files" or "embedded"
    identity: str  # stable across machines and mount points (no paths), part of the reuse key
    train: Sequence[str]
    val: Sequence[str]
    input_sha256: str


def load_corpus(source: DataSource, *, val_fraction: float, log: Callable[[str], None]) -> Corpus:
    """Read the text ``source`` names and split it into train/validation documents.

    Returns a Corpus with at least one document on each side. Raises DataError for a missing or
    empty text file, a glob matching nothing, a corpus too small to split, or a dataset that cannot
    be loaded (e.g. the Hub is unreachable and the dataset is not in the local HF cache).
    """
    if source.text_files and source.dataset:
        raise DataError("both --dataset and --text-files were given; fix: pass only one of them")
    if source.dataset_config and not source.dataset:
        raise DataError("--dataset-config was given without --dataset; fix: add --dataset NAME or drop it")
    if source.text_files:
        return text_files_corpus(source.text_files, val_fraction)
    if source.dataset:
        return hf_corpus(source.dataset, source.dataset_config, val_fraction)
    return _auto_corpus(val_fraction, log)


# ---------------------------------------------------------------------------------------------- hub


def hub_offline_by_env() -> bool:
    """True when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set to a true value (1/true/yes/on)."""
    return any(os.environ.get(var, "").strip().lower() in _TRUE_VALUES for var in _OFFLINE_VARS)


def hub_endpoint() -> str:
    """The Hub URL the HF libraries use: ``HF_ENDPOINT`` or https://huggingface.co."""
    return os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hub answers an HTTP request within ``timeout_s`` seconds (one try, no retries).

    False at once when the offline variables are set. The request runs in a daemon thread so that a
    hanging DNS lookup (which urllib's timeout does not cover) cannot stall the caller.
    """
    if hub_offline_by_env():
        return False
    answers: list[bool] = []
    probe = threading.Thread(target=lambda: answers.append(_http_answers(hub_endpoint(), timeout_s)))
    probe.daemon = True
    probe.start()
    probe.join(timeout_s)
    return bool(answers and answers[0])


def _http_answers(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True  # an HTTP error status still means the server is there
    except Exception:
        return False  # refused, DNS failure, timeout, malformed HF_ENDPOINT: all mean "not usable"


def go_offline() -> None:
    """Put the Hugging Face libraries in offline mode for the rest of this process, through their
    documented variables (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``) in ``os.environ``.

    They read these once, at import, so call this before ``datasets`` is first imported. If it was
    imported already (by a program that imports this module), the variables come too late: loads
    then run as that import configured them, and an unreachable Hub costs its retries. This process
    never imports ``datasets`` before deciding (see ``_load_hf_dataset``).
    """
    os.environ.update(dict.fromkeys(_OFFLINE_VARS, "1"))


# ----------------------------------------------------------------------------------- HF datasets


def hf_corpus(name: str, config: str | None, val_fraction: float, *, reachable: bool | None = None) -> Corpus:
    """Load ``name``/``config`` with ``datasets.load_dataset``; its train and validation splits.

    Without a validation split the last ``val_fraction`` of train documents become validation.
    When the Hub is unreachable the process switches to HF offline mode (``go_offline``) before
    importing ``datasets``, so a local HF cache or dataset directory still loads, without retries.
    Raises DataError when the dataset cannot be loaded or has no usable text.
    """
    if config is None and name == DEFAULT_DATASET:
        config = DEFAULT_WIKITEXT_CONFIG
    label = name if config is None else f"{name} ({config})"
    online = hub_reachable() if reachable is None else reachable
    dataset = _load_hf_dataset(name, config, label, online=online)
    train, val = _hf_splits(dataset, label, val_fraction)
    return Corpus(
        description=f"Hugging Face dataset {label}",
        kind="hf",
        identity=f"hf:{name}:{config}",
        train=train,
        val=val,
        input_sha256=_sha256_documents(train, val),
    )


def _load_hf_dataset(name: str, config: str | None, label: str, *, online: bool) -> Any:
    if not online:
        go_offline()  # before the import below: datasets reads the variables when imported
    import datasets  # slow import (~1 s): only when a Hugging Face dataset is actually used

    try:
        return datasets.load_dataset(name, config)
    except Exception as e:  # datasets raises many unrelated types for "could not load"
        raise DataError(_hf_failure_message(label, online, e)) from e


def _hf_failure_message(label: str, online: bool, error: Exception) -> str:
    cause = f"({type(error).__name__}: {error})"
    if online:
        return (
            f"could not load Hugging Face dataset {label} {cause}; fix: check the name and config "
            f"(--dataset, --dataset-config) or use your own text with {_FIX_OWN_TEXT}"
        )
    return (
        f"cannot load Hugging Face dataset {label}: the Hub ({hub_endpoint()}) is unreachable and the "
        f"dataset is not in the local HF cache {cause}; fix: use local text with {_FIX_OWN_TEXT}, or "
        "pre-populate the HF cache on a machine with internet and point HF_DATASETS_CACHE (or HF_HOME) at it"
    )


def _hf_splits(dataset: Any, label: str, val_fraction: float) -> tuple[list[str], list[str]]:
    splits = list(dataset.keys())
    if "train" not in splits:
        raise DataError(f"{label} has no 'train' split (it has {splits}); fix: use {_FIX_OWN_TEXT}")
    train = _hf_documents(dataset["train"], label)
    val_split = next((s for s in ("validation", "valid") if s in splits), None)
    val = _hf_documents(dataset[val_split], label) if val_split else []
    if not val:  # no validation split (or an empty one): carve it from train, as for text files
        return carve_validation(train, val_fraction, label)
    if not train:
        raise DataError(f"{label} has an empty 'train' split; fix: use {_FIX_OWN_TEXT}")
    return train, val


def _hf_documents(split: Any, label: str) -> list[str]:
    if "text" not in split.column_names:
        raise DataError(
            f"{label} has no 'text' column (columns: {split.column_names}); fix: use {_FIX_OWN_TEXT}"
        )
    return documents_from_lines(split["text"])


# ------------------------------------------------------------------------------------ text files


def text_files_corpus(patterns: Iterable[str], val_fraction: float) -> Corpus:
    """Read local text files (paths or globs); each non-blank line is one document.

    Files are read in sorted path order; the last ``val_fraction`` of all documents (at least one,
    leaving at least one for training) become validation. Raises DataError for a missing file, a
    glob that matches nothing, a directory, a non-UTF-8 or empty file, or fewer than 2 documents.
    """
    paths = expand_text_files(patterns)
    docs: list[str] = []
    digests: list[str] = []
    for path in paths:
        data = _read_bytes(path)
        file_docs = documents_from_lines(_decode_utf8(path, data).split("\n"))
        if not file_docs:
            raise empty_file_error(path)
        docs.extend(file_docs)
        digests.append(hashlib.sha256(data).hexdigest())
    label = _describe_files(paths)
    train, val = carve_validation(docs, val_fraction, label)
    input_sha256 = hashlib.sha256("".join(d + "\n" for d in digests).encode()).hexdigest()
    return Corpus(label, "text-files", "text-files", train, val, input_sha256)


def empty_file_error(path: Path) -> DataError:
    return DataError(
        f"text file {path} is empty (or only whitespace); fix: remove it from --text-files "
        "or put text in it (one document per line)"
    )


def expand_text_files(patterns: Iterable[str]) -> list[Path]:
    """Resolved, sorted, de-duplicated files named by ``patterns`` (``~`` and glob patterns expanded).

    Raises DataError for a missing path, a directory, or a glob pattern that matches no file.
    """
    found: set[Path] = set()
    for pattern in patterns:
        found.update(_expand_one(pattern))
    if not found:
        raise DataError(f"no text files given; fix: pass {_FIX_OWN_TEXT}")
    return sorted(found)


def _expand_one(pattern: str) -> list[Path]:
    expanded = os.path.expanduser(pattern)
    if glob.has_magic(expanded):
        matches = [Path(p).resolve() for p in glob.glob(expanded, recursive=True) if Path(p).is_file()]
        if not matches:
            raise DataError(
                f"--text-files pattern {pattern!r} matched no files; fix: check the pattern "
                "(quote it so that the shell passes it unexpanded) and the current directory"
            )
        return matches
    path = Path(expanded)
    if path.is_dir():
        raise DataError(f"--text-files {pattern} is a directory; fix: pass its files, e.g. '{pattern}/*.txt'")
    if not path.is_file():
        raise DataError(f"text file {pattern} not found ({path.resolve()}); fix: check the --text-files path")
    return [path.resolve()]


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read text file {path} ({e.strerror}); fix: check its permissions") from e


def _decode_utf8(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")  # -sig: a leading byte-order mark is not text
    except UnicodeDecodeError as e:
        raise DataError(
            f"text file {path} is not UTF-8 (bad byte at offset {e.start}); "
            "fix: convert it, e.g. `iconv -f LATIN1 -t UTF-8`"
        ) from e


def _describe_files(paths: Sequence[Path]) -> str:
    if len(paths) == 1:
        return f"text file {paths[0]}"
    shown = ", ".join(str(p) for p in paths[:3])
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    return f"{len(paths)} text files: {shown}{more}"


# -------------------------------------------------------------------------------- embedded corpus


def embedded_corpus(val_fraction: float) -> Corpus:
    """The English prose of Python's own docs (``pydoc_data.topics``), one paragraph per document.

    Always available offline (~465 KB, ~79 topics). Raises DataError if this Python lacks pydoc_data.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise DataError(
            "the embedded corpus (pydoc_data.topics) is missing from this Python installation; "
            f"fix: use {_FIX_OWN_TEXT} or --dataset wikitext"
        ) from e
    # Paragraphs are separated by blank lines; strip only newlines to keep code-block indentation.
    docs = [p.strip("\n") for name in sorted(topics) for p in topics[name].split("\n\n") if p.strip()]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    label = f"embedded corpus: Python {version} documentation topics (pydoc_data.topics)"
    train, val = carve_validation(docs, val_fraction, label)
    identity = f"embedded:pydoc_data.topics:{version}"
    return Corpus(label, "embedded", identity, train, val, _sha256_documents(train, val))


def _auto_corpus(val_fraction: float, log: Callable[[str], None]) -> Corpus:
    if hub_reachable():
        log(f"data: no --dataset or --text-files given; the Hub is reachable: using {DEFAULT_DATASET}")
        try:
            return hf_corpus(DEFAULT_DATASET, None, val_fraction, reachable=True)
        except DataError as e:
            log(f"data: {e}; falling back to the embedded corpus")
    corpus = embedded_corpus(val_fraction)
    why = "HF offline mode is set" if hub_offline_by_env() else f"the Hub ({hub_endpoint()}) is unreachable"
    log(
        f"data: no --dataset or --text-files given and {why}: using the {corpus.description}. "
        "For WikiText pass --dataset wikitext (needs internet or a populated HF cache); "
        "for your own text pass --text-files PATH..."
    )
    return corpus


# --------------------------------------------------------------------------------------- helpers


def documents_from_lines(lines: Iterable[Any]) -> list[str]:
    """Non-blank lines as documents, each without its line terminator (other whitespace is kept)."""
    return [line.rstrip("\r\n") for line in lines if isinstance(line, str) and line.strip()]


def carve_validation(docs: list[str], val_fraction: float, label: str) -> tuple[list[str], list[str]]:
    """Split ``docs`` into (train, val): val is the last ``val_fraction`` (rounded, >= 1 document).

    The split is contiguous so that neighbouring paragraphs of one article rarely straddle it.
    Raises DataError when there are fewer than 2 documents.
    """
    if len(docs) < 2:
        raise DataError(
            f"{label} has {len(docs)} document(s) (non-blank lines); at least 2 are needed to carve "
            "a validation split; fix: add more text (more lines or more --text-files)"
        )
    n_val = min(len(docs) - 1, max(1, round(len(docs) * val_fraction)))
    return docs[:-n_val], docs[-n_val:]


def _sha256_documents(*splits: Sequence[str]) -> str:
    # Length-prefixed so that different document boundaries can never hash alike.
    digest = hashlib.sha256()
    for docs in splits:
        digest.update(f"{len(docs)};".encode())
        for doc in docs:
            data = doc.encode()
            digest.update(f"{len(data)}:".encode() + data)
    return digest.hexdigest()
