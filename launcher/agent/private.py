"""Directories only this user may use: the ssh ControlMaster sockets and the host agent's node
files live in them, and another user who could plant a symlink or a socket there could hijack a
connection or point ``launcher.agent signal`` at someone else's process."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeDirError(RuntimeError):
    """A private directory exists but is a symlink, another user's, or open to others."""


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) with mode 0700 if missing, and return it. Raises
    UnsafeDirError when it is a symlink, not owned by this user, or readable/writable by others: the
    message names the directory and the fix."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is a symlink" if stat.S_ISLNK(info.st_mode) else "is not a directory"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not to you (uid {os.getuid()})"
    elif info.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}, open to other users"
    else:
        return path
    raise UnsafeDirError(f"{path} {problem}: remove it (or `chmod 700` it if it is yours) and retry")
