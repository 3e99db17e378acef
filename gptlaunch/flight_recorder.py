"""This rank's flight recorder, readable from outside while the rank hangs.

When the launcher watches the rank (``GPTLAUNCH_HEARTBEAT_DIR`` set), torch's flight recorder keeps the
last ``BUFFER_ENTRIES`` collectives of every process group, gloo's and NCCL's (``TORCH_FR_BUFFER_SIZE``;
``TORCH_NCCL_TRACE_BUFFER_SIZE`` in releases before it), and torch's worker server (``_WorkerServer``,
what ``torch.distributed.elastic.control_plane.worker_main`` starts) answers on a Unix socket:
``POST /handler/fr_trace_json`` (``dump_nccl_trace_json`` for NCCL's). The server is a C++ thread: it
answers while the Python main thread is blocked in a collective, and the launcher's watchdog asks it
which collective each rank reached (``launcher.supervisor.watchdog``). A value the user set is kept.

Cost: one record per collective (a few per step under DDP) and an idle thread; no collective.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import sys
import tempfile
from pathlib import Path

BUFFER_ENTRIES = 2000
# The buffer's size variable: TORCH_FR_BUFFER_SIZE from torch 2.8 (NVIDIA/nvidia-resiliency-ext#163),
# which warns on every rank when the older name is also set; TORCH_NCCL_TRACE_BUFFER_SIZE before.
BUFFER_ENV, LEGACY_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"
_servers: list[object] = []


def socket_path(heartbeat_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` of the node whose heartbeats go to ``heartbeat_dir`` serves: in a directory
    of this user's in the temp directory (the server answers anyone who can connect), not the job
    record, since a Unix socket's path must stay under 108 bytes."""
    digest = hashlib.sha1(str(heartbeat_dir.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"gptlaunch-{os.getuid()}" / f"fr-{digest}-{rank}.sock"


def buffer_env() -> str:
    """The variable this torch reads the flight recorder's size from."""
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return BUFFER_ENV if (major, minor) >= (2, 8) else LEGACY_BUFFER_ENV


def start(heartbeat_dir: Path, rank: int) -> str | None:
    """Turn the flight recorder on (before the process group is made: torch reads the size then) and
    serve it; the socket's path, or None where this torch has no worker server or it cannot start
    (a warning: the watchdog still takes Python stacks)."""
    if BUFFER_ENV not in os.environ and LEGACY_BUFFER_ENV not in os.environ:
        os.environ[buffer_env()] = str(BUFFER_ENTRIES)
    path = socket_path(heartbeat_dir, rank)
    try:
        from torch._C._distributed_c10d import _WorkerServer

        path.parent.mkdir(mode=0o700, exist_ok=True)
        if path.parent.stat().st_uid != os.getuid() or path.parent.stat().st_mode & 0o077:
            raise OSError(f"{path.parent} is not private to this user")
        path.unlink(missing_ok=True)  # a previous run's
        server = _WorkerServer(str(path))
    except (ImportError, RuntimeError, OSError) as e:
        print(f"warning: no flight recorder server at {path}: {e}", file=sys.stderr, flush=True)
        return None
    _servers.append(server)  # alive until the process ends (a shutdown() logs two warnings)
    atexit.register(_remove, path)
    return str(path)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
