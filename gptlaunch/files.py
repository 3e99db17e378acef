"""Atomic file writes: a reader sees the old content or the new, never a part (checkpoints, metrics,
job records, stop markers)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Yield a binary file to write ``path``'s new content into. On success the temporary file is
    fsynced, renamed over ``path`` and the directory fsynced; on any error it is removed and ``path``
    is left as it was. The new file's mode is 0666 less the umask, like any file the process makes.
    Raises what the writes raise (e.g. OSError for a full disk)."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    # os.open applies the umask itself: no need to read it (reading it means setting it, which races
    # with other threads creating files).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text.encode())


def fsync_dir(directory: Path) -> None:
    """Make renames in ``directory`` durable (a rename is on disk only once its directory entry is)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)
