"""Atomic file writes: a reader or a crash sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Yield a binary file to write ``path``'s new content into. On success the temporary file is
    fsynced, renamed over ``path`` and the directory fsynced; on any error it is removed and ``path``
    is left as it was. Raises what the writes raise (e.g. OSError for a full disk)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; others may need to read these files
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


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
