"""Atomic writes: whole files only, modes from the umask, and the umask never touched."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gptlaunch.files import atomic_write, atomic_write_text


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_write(path) as f:
        f.write(b"half")
        raise RuntimeError("disk full")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_the_file_mode_follows_the_umask_without_changing_it(tmp_path: Path) -> None:
    probe = (
        "import os, sys; from pathlib import Path\n"
        "os.umask(0o027)\n"
        "def refuse(mask): raise AssertionError('the umask was changed')\n"
        "os.umask = refuse  # another thread may be creating files: never set it, not even briefly\n"
        "from gptlaunch.files import atomic_write_text\n"
        "atomic_write_text(Path(sys.argv[1]), 'x')\n"
    )
    path = tmp_path / "f.json"
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
