"""Workers forked from a warm process instead of started from nothing (a "zygote", as Android's).

Every start of a rank costs a new interpreter importing torch: about 3 s of the 8.9 s a local start
takes on a 2-core machine (``docs/benchmarks.md``), and the same again at each retry. A zygote is a
process that has imported torch (and ``torch._dynamo``, which AdamW's first use imports) and waits on
a Unix socket (one per job on the local scheduler: ``launcher.schedulers.local.warm``). A rank then
starts as a small client, ``python -m gptlaunch.warm run SOCKET -- PROGRAM ARGS``, which hands its
argv, environment, working directory and standard streams to the zygote; the zygote forks, and the
child runs the program as ``python PROGRAM ARGS`` would.

The client stands for the child towards whoever started it (torchrun): it relays SIGTERM, SIGINT,
SIGHUP, SIGUSR1 and SIGUSR2 to the child, and ends as the child ended: the same exit code, or killed
by the same signal (so torchrun, and the launcher's root cause after it, see what they would have
seen). When the client dies first (SIGKILL), the zygote kills its child; when the zygote dies, the
kernel kills its children. When no zygote answers, the client runs the program itself, cold: a
zygote only ever saves time. A child sets its process title to its program (``setproctitle``), so
``ps`` shows the rank, not the zygote; its ``/proc/PID/environ`` remains the zygote's.

What the zygote imports must not depend on what differs between ranks: it imports only torch and
third-party packages, never CUDA (a forked CUDA context is unusable), and never this project's
modules. Environment variables that torch reads at import (``TORCH_LOGS``, Inductor's and Dynamo's
configuration) are the zygote's: start it with the job's. ``OMP_NUM_THREADS`` (read once by libgomp)
and ``PYTHONPATH`` are applied again in each child from its client's environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import selectors
import shlex
import signal
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

import setproctitle

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel")
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_MAX_REQUEST = 1 << 20  # bytes: an environment and argv, with room to spare


@dataclass(frozen=True)
class Request:
    """What a client hands to the zygote: the program's argv (``-m MODULE ARGS`` or ``SCRIPT ARGS``),
    its environment and its working directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> NoReturn:
    """The zygote: import ``preload``, then fork a child for each client on the Unix socket ``path``
    (mode 0600), until SIGTERM. Never returns."""
    for module in preload:
        importlib.import_module(module)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old_umask)
    listener.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print(f"gptlaunch.warm: ready on {path} (pid {os.getpid()})", flush=True)
    # One thread (a fork copies only the forking thread): the listener, each client's connection
    # (readable when the client is gone) and each child's pidfd (readable when it ended) in one selector.
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is listener:
                _start_child(listener, sel)
            else:
                _child_event(key.data, sel)


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket
    done: bool = False


def _start_child(listener: socket.socket, sel: selectors.BaseSelector) -> None:
    conn, _ = listener.accept()
    request, fds = _receive(conn)
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:  # the other clients' connections and children are not this child's
        for key in list(sel.get_map().values()):
            os.close(key.fd)
        _become(request, fds, conn, zygote)
    for fd in fds:
        os.close(fd)
    child = _Child(pid, os.pidfd_open(pid), conn)
    conn.sendall(f"{pid}\n".encode())
    sel.register(child.pidfd, selectors.EVENT_READ, child)
    sel.register(conn, selectors.EVENT_READ, child)


def _child_event(child: _Child, sel: selectors.BaseSelector) -> None:
    """The child ended (tell its client how) or its client went (kill the child, then reap it)."""
    if child.done:  # both of its events came in one select
        return
    child.done = True
    ended = os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED | os.WNOHANG)
    if ended is None:  # the client is gone: its child goes too
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED)
        status = None
    else:
        status = ended
    sel.unregister(child.pidfd)
    sel.unregister(child.conn)
    os.close(child.pidfd)
    if status is not None:
        with contextlib.suppress(OSError):
            child.conn.sendall(f"{_wait_status(status)}\n".encode())
    child.conn.close()


def _wait_status(info: os.waitid_result) -> int:
    """The waitpid-style status of a waitid result (an exit code, or a signal)."""
    if info.si_code == os.CLD_EXITED:
        return (info.si_status & 0xFF) << 8
    return info.si_status & 0x7F  # killed or dumped: the signal


def _receive(conn: socket.socket) -> tuple[Request, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
    fields = json.loads(data)
    return Request(fields["argv"], fields["env"], fields["cwd"]), list(fds)


def _become(request: Request, fds: list[int], conn: socket.socket, zygote: int) -> NoReturn:
    """In the forked child: take the client's streams, environment and directory, then run the
    program. Never returns."""
    conn.close()
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin, sys.stdout, sys.stderr = (
        open(0, closefd=False),  # noqa: SIM115 (the process's own streams, for its whole life)
        open(1, "w", closefd=False),  # noqa: SIM115
        open(2, "w", closefd=False),  # noqa: SIM115
    )
    for sig in RELAYED:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    _die_with_zygote(zygote)
    # What `ps`, `top` and nvidia-smi show: the program, not the zygote it was forked from.
    setproctitle.setproctitle(shlex.join([sys.executable, *request.argv]))
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    _as_started(request.env)
    code = 0
    try:
        _run(request.argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(code)


def _die_with_zygote(zygote: int) -> None:
    """Have the kernel SIGKILL this child when the zygote dies (by SIGKILL too): a rank must not run
    on once the process that stands for it to torchrun (its client) can no longer be told its end."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote:  # the zygote died before the request took effect
        os._exit(1)


def _as_started(env: dict[str, str]) -> None:
    """What a fresh interpreter would have read from ``env`` at start, and the zygote read from its
    own: ``PYTHONPATH``'s entries on ``sys.path``, and ``OMP_NUM_THREADS`` (libgomp reads it once, when
    torch is imported) as torch's intra-op thread count."""
    for entry in reversed([e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _run(argv: list[str]) -> None:
    """Run ``-m MODULE ARGS`` or ``SCRIPT ARGS`` as ``python`` would."""
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()  # as `python -m` puts its working directory first
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def run(path: str, argv: list[str]) -> NoReturn:
    """The client: have the zygote on ``path`` run ``argv`` and end as it ends; without a zygote,
    run ``argv`` in this process. Never returns."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        os.execv(sys.executable, [sys.executable, *argv])
    child: list[int] = []  # its pid, once the zygote said it
    pending: list[int] = []  # signals that came before
    for sig in RELAYED:
        signal.signal(sig, lambda s, _f: _relay(child[0], s) if child else pending.append(s))
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    reader = conn.makefile("r")
    child.append(int(reader.readline()))
    for early in pending:
        _relay(child[0], early)
    line = reader.readline()
    if not line:  # the zygote died: its child with it
        os._exit(1)
    _end_as(int(line))


def _relay(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _end_as(status: int) -> NoReturn:
    """Exit as a child with wait status ``status`` did: its code, or its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig in RELAYED:  # our own relay handler would catch it
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def main(argv: list[str]) -> None:
    usage = "usage: python -m gptlaunch.warm serve SOCKET | run SOCKET -- PROGRAM [ARGS...]"
    if len(argv) >= 2 and argv[0] == "serve":
        serve(argv[1])
    if len(argv) >= 4 and argv[0] == "run" and argv[2] == "--":
        run(argv[1], argv[3:])
    sys.exit(usage)


if __name__ == "__main__":
    main(sys.argv[1:])
