"""The CPU's kernel builds beside the compile artifacts (trainer.compile_kernels): what is kept, what
a spare's cache dir gets, and what a tar may not do to it."""

from __future__ import annotations

import ctypes
import io
import shutil
import tarfile
from pathlib import Path

import pytest

from trainer import compile_kernels

LOADABLE = Path("/lib/x86_64-linux-gnu/libm.so.6")  # any shared object this process may load


def _build(root: Path, name: str, data: bytes = b"\x7fELF") -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_the_builds_travel_to_a_cache_dir_that_lacks_them_and_keep_what_it_has(tmp_path: Path) -> None:
    first, spare = tmp_path / "first", tmp_path / "spare"
    built = [_build(first, "ab/cabc.so", b"one"), _build(first, "cd/ccd.main.so", b"two")]
    _build(first, "ef/cef.cpp", b"source")  # not a build: not found, not kept
    assert compile_kernels.builds(first) == set(built)
    kept = _build(spare, "ab/cabc.so", b"the spare's own")
    assert compile_kernels.unpack(compile_kernels.pack(first, built), spare) == 1
    assert (spare / "cd" / "ccd.main.so").read_bytes() == b"two"
    assert kept.read_bytes() == b"the spare's own"  # present: never overwritten under a reader
    assert not list(spare.rglob(".*.tmp"))  # each written under a temporary name, then renamed


def test_a_tar_writes_nothing_but_builds_inside_the_cache_dir(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("../outside.so", "/abs/olute.so", "ab/../../up.so", "ab/not-a-build.txt", "ab/ok.so"):
            member = tarfile.TarInfo(name)
            member.size = 2
            tar.addfile(member, io.BytesIO(b"xx"))
        link = tarfile.TarInfo("cd/link.so")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    root = tmp_path / "cache"
    root.mkdir()
    assert compile_kernels.unpack(buffer.getvalue(), root) == 1
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()] == [
        "cache/ab/ok.so"
    ]
    with pytest.raises(tarfile.TarError):
        compile_kernels.unpack(b"not a tar at all" * 64, root)


def test_what_this_process_has_loaded_is_found_by_its_memory_map(tmp_path: Path) -> None:
    loaded = tmp_path / "ab" / "cloaded.so"
    loaded.parent.mkdir()
    shutil.copy(LOADABLE, loaded)
    _build(tmp_path, "cd/cnot_loaded.so")
    ctypes.CDLL(str(loaded))
    assert compile_kernels.mapped(tmp_path) == {loaded}
