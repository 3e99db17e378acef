"""Atomic file writes: a reader sees the old content or the new, never a part (checkpoints, metrics,
job records, stop markers); and, for the files that must be whole to be used (checkpoints, snapshots),
a sha256 of their bytes written with them (``atomic_write_checked``) and checked on reading
(``check_digest``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, cast

DIGEST_SUFFIX = ".sha256"  # ``NAME.sha256`` next to ``NAME``: one line in sha256sum's format
_PARALLEL_HASH_BYTES = 1 << 20  # writes from this size on are hashed on a thread of their own
_DIGEST_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)\n?")


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


class DigestError(ValueError):
    """A file's bytes differ from those its digest was computed over (or its digest file is not one)."""


def digest_path(path: Path) -> Path:
    """Where ``path``'s digest is: ``NAME.sha256`` next to it."""
    return path.with_name(path.name + DIGEST_SUFFIX)


class _HashingWriter:
    """Passes writes on to ``f`` and hashes them as they pass: the digest costs no read-back of the
    file (torch.save only calls ``write`` and ``flush`` on a file object). A large write is hashed on
    ``hasher``'s thread while this one writes it (both let go of the GIL): the save then takes about
    the longer of the two, not their sum (``benchmarks/bench_checksum.py``, 50 MB on a 2-core VM: +25%
    over a plain save, against +53% hashed in turn)."""

    def __init__(self, f: BinaryIO, hasher: ThreadPoolExecutor) -> None:
        self._f = f
        self._hasher = hasher
        self._sha256 = hashlib.sha256()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if len(data) < _PARALLEL_HASH_BYTES:  # headers, small tensors: a thread's hand-off costs more
            self._sha256.update(data)
            return self._f.write(data)
        hashing = self._hasher.submit(self._sha256.update, data)
        try:
            return self._f.write(data)
        finally:
            hashing.result()  # before returning: the caller may reuse ``data``, and order matters

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._sha256.hexdigest()


@contextlib.contextmanager
def atomic_write_checked(path: Path) -> Iterator[BinaryIO]:
    """``atomic_write``, and the sha256 of the bytes written (hashed as they are written, never read
    back) into ``digest_path(path)``, itself written atomically.

    The digest goes into place before the file does: a new file under ``path``'s name always has its
    digest next to it (a crash between the two leaves a digest without its file, which
    ``check_digest`` never reads). A failed write removes the digest it wrote. A file already at
    ``path`` (the same step saved again) loses its digest first: a crash then leaves it without one,
    checked by other means, never beside the new file's digest, which it would not match. Raises what
    the writes raise (OSError for a full disk)."""
    digest = digest_path(path)
    digest_written = False
    if path.exists():
        digest.unlink(missing_ok=True)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher, atomic_write(path) as f:
            writer = _HashingWriter(f, hasher)
            yield cast(BinaryIO, writer)
            atomic_write_text(digest, f"{writer.hexdigest()}  {path.name}\n")
            digest_written = True
    except BaseException:
        if digest_written:  # the file itself did not reach its name: its digest must not stay
            digest.unlink(missing_ok=True)
        raise


def sha256_of(path: Path) -> str:
    """The sha256 of ``path``'s bytes, hex. Raises OSError when it cannot be read."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_digest(path: Path) -> bool:
    """Whether ``path`` was checked against the digest written with it: True when its bytes match
    it, False when it has no digest file (written before digests were, or by another program).

    Raises DigestError when the bytes differ (truncated, a flipped bit) or the digest file is not
    one; OSError when either file cannot be read."""
    try:
        line = digest_path(path).read_text()
    except FileNotFoundError:
        return False
    match = _DIGEST_LINE.fullmatch(line)
    if match is None:
        raise DigestError(f"its checksum file {digest_path(path).name} is not a sha256 line")
    actual = sha256_of(path)
    if actual != match.group(1):
        raise DigestError(
            f"checksum mismatch: sha256 {actual[:12]}… over its {path.stat().st_size} bytes, "
            f"{match.group(1)[:12]}… when written"
        )
    return True


# The errors of a write that does not fit: the file system is full, or the user's quota is.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def no_space(error: BaseException) -> OSError | None:
    """The OSError for a full file system or quota (``NO_SPACE_ERRNOS``) behind ``error``: itself, or
    one it was raised from or while handling (torch.save turns a failed write into a RuntimeError,
    "unexpected pos", raised while the OSError is handled); None when there is none."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in NO_SPACE_ERRNOS:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the file system of ``path`` (its nearest existing ancestor); a quota
    is not seen here, only when a write fails (EDQUOT)."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free
