"""Workers forked from a warm process instead of started from nothing (a "zygote", as Android's).

Every start of a rank costs a new interpreter importing torch: about 3 s of the 8.9 s a local start
takes on a 2-core machine (``docs/benchmarks.md``), and the same again at each retry. A zygote is a
process that has imported torch (and ``torch._dynamo``, which AdamW's first use imports) and waits on
a Unix socket (one per job on the local scheduler: ``launcher.schedulers.local.warm``). A rank then
starts as a small client, ``python -m gptlaunch.warm run SOCKET -- PROGRAM ARGS``, which hands its
argv, environment, working directory and standard streams to the zygote; the zygote forks, and the
child runs the program as ``python PROGRAM ARGS`` would (``zygote``).

The client (``client``) stands for the child towards whoever started it (torchrun): it relays
SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to the child, and ends as the child ended: the same exit
code, or killed by the same signal (so torchrun, and the launcher's root cause after it, see what
they would have seen). When the client dies first (SIGKILL), the zygote kills its child; when the
zygote is killed, the kernel kills its children; a zygote asked to stop (SIGTERM) waits for its
children, which their clients are stopping. When no zygote answers, the client runs the program
itself, cold: a zygote only ever saves time. A child sets its process title to its program
(``setproctitle``), so ``ps`` shows the rank, not the zygote; its ``/proc/PID/environ`` remains the
zygote's, and so does its hash seed (``PYTHONHASHSEED``).

What the zygote imports must not depend on what differs between ranks: it imports only torch and
third-party packages, never CUDA (a forked CUDA context is unusable), and never this project's
modules. Environment variables that torch reads at import (``TORCH_LOGS``, Inductor's and Dynamo's
configuration) are the zygote's: start it with the job's. ``OMP_NUM_THREADS`` (read once by libgomp)
and ``PYTHONPATH`` are applied again in each child from its client's environment.

The request on the socket: 8 bytes of length (big-endian), then that many bytes of JSON (``Request``),
with the client's fds 0-2 attached (SCM_RIGHTS) to the first bytes. The replies: the child's pid, then
its wait status (``os.waitpid``'s), one decimal line each. Each end checks that the other is the same
user (SO_PEERCRED): the request carries the environment, secrets included.

A socket is a path, or ``@NAME``: Linux's abstract namespace, which belongs to the network namespace
and not to the file system (the SSH scheduler's zygote, one per job and host: hosts that share a
``/tmp``, as containers or network namespaces on one machine may, still each reach their own).
"""

from __future__ import annotations

import signal
import socket
import struct
from dataclasses import dataclass

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
LENGTH_BYTES = 8


@dataclass(frozen=True)
class Request:
    """What a client hands to the zygote: the program's argv (``-m MODULE ARGS`` or ``SCRIPT ARGS``),
    its environment and its working directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


def address(socket_name: str) -> str:
    """What ``socket.bind``/``connect`` take for ``socket_name``: a path as it is, ``@NAME`` as the
    abstract address ``\\0NAME``."""
    return "\0" + socket_name[1:] if socket_name.startswith("@") else socket_name


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of the Unix socket ``conn`` (SO_PEERCRED)."""
    _, uid, _ = struct.unpack("iII", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(uid)
