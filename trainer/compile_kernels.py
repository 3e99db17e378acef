"""On a CPU, Inductor's C++ kernel builds travel with the compile artifacts (``trainer.compile_cache``).

torch's portable artifacts (``torch.compiler.save_cache_artifacts``) hold the compiled graphs but, on
a CPU, not the shared objects g++ builds for their kernels: a spare host that loads them still builds
every kernel again, 12 of the 15 s of a retry's start-up on a spare here (docs/benchmarks.md). The
builds live in Inductor's cache dir as ``XX/<hash>.so``, the hash being that of the kernel's source
and of the whole compiler command (torch's include paths, the flags, the vector ISA), so a build is
looked up only where the same source would be built by the same command; the compile cache's own
key adds torch's version and the CPU's vector ISA.

Kept: every build this process made (new in the cache dir since the load) and every one it has
mapped (those it found built), one tar beside the artifacts, with its sha256. Loaded: each build the
cache dir lacks, written under a temporary name and renamed, so a rank of the same host that looks
it up meanwhile finds it whole or not at all.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path

BUILD_NAME = re.compile(r"[a-z0-9]{2}/[a-z0-9][a-z0-9_.]*\.so")  # Inductor's XX/<hash>[.main].so


def inductor_cache_dir() -> Path:
    """This process's Inductor cache dir (``TORCHINDUCTOR_CACHE_DIR`` or torch's default), created."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # how Inductor itself resolves it

    return Path(cache_dir())


def builds(root: Path) -> set[Path]:
    """The kernel builds in the cache dir ``root``."""
    return set(root.glob("*/*.so"))


def mapped(root: Path) -> set[Path]:
    """The builds under ``root`` that this process has loaded (its memory map, ``/proc/self/maps``;
    none where there is no such file)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    paths = {Path(fields[5]) for line in lines if len(fields := line.split(maxsplit=5)) == 6}
    return {p for p in paths if p.parent.parent == root and p.suffix == ".so"}


def pack(root: Path, files: Iterable[Path]) -> bytes:
    """A tar of ``files`` (builds under ``root``), named relative to it; a file gone meanwhile is left out."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(files):
            with contextlib.suppress(FileNotFoundError):
                tar.add(path, arcname=path.relative_to(root).as_posix())
    return buffer.getvalue()


def unpack(data: bytes, root: Path) -> int:
    """Write each build of the tar ``data`` that ``root`` lacks; returns how many. A member that is
    not a regular file named as a build is skipped. Raises tarfile.TarError for a damaged tar, OSError
    when the cache dir cannot be written."""
    written = 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            target = root / member.name
            if not member.isfile() or not BUILD_NAME.fullmatch(member.name) or target.exists():
                continue
            source = tar.extractfile(member)
            if source is None:
                continue
            target.parent.mkdir(exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            partial.write_bytes(source.read())
            partial.chmod(0o755)
            os.replace(partial, target)
            written += 1
    return written
