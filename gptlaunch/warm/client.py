"""The client a rank starts as (``gptlaunch.warm``): it has the zygote fork the program, relays
signals to the child and ends as the child ended; without a zygote it runs the program itself."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from typing import NoReturn

from gptlaunch.warm import LENGTH_BYTES, RELAYED, address, peer_uid


def run(path: str, argv: list[str]) -> NoReturn:
    """Have the zygote on the socket ``path`` (a path or ``@NAME``) run ``argv`` and end as it ends;
    without a zygote, run ``argv`` in this process (``exec``). Never returns."""
    child: list[int] = []  # its pid, once the zygote said it
    pending: list[int] = []  # signals that came before: relayed once the pid is known
    for sig in RELAYED:  # before anything else: a stop sent at once is not lost
        signal.signal(sig, lambda s, _f: _relay(child[0], s) if child else pending.append(s))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address(path))
        if peer_uid(conn) != os.getuid():  # not our zygote: it would get the environment and streams
            raise OSError(f"{path} is served by another user")
    except OSError:
        conn.close()
        _run_cold(argv, pending)
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(conn, [len(body).to_bytes(LENGTH_BYTES, "big")], [0, 1, 2])
        conn.sendall(body)
    except OSError:  # the zygote went before it had the request: nothing was forked
        conn.close()
        _run_cold(argv, pending)
    reader = conn.makefile("r")
    pid = reader.readline()
    if not pid.strip().isdigit():  # it refused the request, or died before forking
        sys.exit(f"gptlaunch.warm: the zygote on {path} did not start {argv[:3]} (see its log)")
    child.append(int(pid))
    for early in pending:
        _relay(child[0], early)
    status = reader.readline()
    if not status.strip():  # the zygote died, and the kernel killed its children
        sys.exit(f"gptlaunch.warm: the zygote on {path} died: its child {child[0]} went with it")
    _end_as(int(status))


def _run_cold(argv: list[str], pending: list[int]) -> NoReturn:
    """Run ``argv`` in this process, as if started so, a signal that came meanwhile acted on."""
    for sig in RELAYED:
        signal.signal(sig, signal.SIG_DFL)
    for early in pending:
        os.kill(os.getpid(), early)
    os.execv(sys.executable, [sys.executable, *argv])


def _relay(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _end_as(status: int) -> NoReturn:
    """Exit as a child with wait status ``status`` did: its code, or its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)  # ours relays, and Python ignores some (SIGPIPE)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is to go on (SIGCHLD, SIGCONT)
    os._exit(os.waitstatus_to_exitcode(status))
