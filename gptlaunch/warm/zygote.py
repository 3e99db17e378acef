"""The zygote (``gptlaunch.warm``): a process that has imported torch and forks a child per client
request, each of which runs the client's program as a fresh ``python`` would."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import io
import json
import os
import runpy
import selectors
import shlex
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import NoReturn

import setproctitle

from gptlaunch.contract import ATTEMPT_ENV
from gptlaunch.warm import LENGTH_BYTES, RELAYED, Request, address, peer_uid

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel")
# Imported too where this torch has it: async checkpoint saves' stager, 0.1 s of a resumed rank's start
# on a 2-core CPU; Inductor's compiler, 0.6 s of a compiled rank's (it starts no thread or process at
# import: its compile workers start with the first compile, in the rank). (Not TensorBoard's writer:
# where TensorFlow is installed, it imports all of it.)
PRELOAD_IF_PRESENT = ("torch.distributed.checkpoint.staging", "torch._inductor.compile_fx")
# Called too where present, their results cached for every fork: Inductor's probe of the CPU's vector
# ISA, which builds and runs small test programs once per process (0.8 s of a rank that compiles on a
# CPU, or keys its compile cache: ``trainer.compile_cache``).
WARM_CALLS = (("torch._inductor.cpu_vec_isa", "pick_vec_isa"),)
MAX_REQUEST = 16 << 20  # bytes: an argv and an environment, with room to spare
RECEIVE_TIMEOUT_S = 10.0  # a client that connects and then says nothing is dropped after this
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket | None  # None once its client is gone


class _Zygote:
    """One thread (a fork copies only the forking thread) and one selector: the listener, each
    client's connection (readable when the client is gone), each child's pidfd (readable when it
    ended), the signal wakeup fd (SIGTERM: stop) and, with a lease, stdin (its end, or ``lease_s``
    seconds without a byte on it: stop)."""

    def __init__(self, listener: socket.socket, lease_s: float | None = None) -> None:
        self.listener = listener
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ)
        self.wakeup, wakeup_w = socket.socketpair()
        wakeup_w.setblocking(False)
        self.wakeup_w = wakeup_w
        self.sel.register(self.wakeup, selectors.EVENT_READ)
        self.lease_s, self.heard = lease_s, time.monotonic()
        if lease_s is not None:
            self.sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
        self.children: dict[int, _Child] = {}
        self.stopping = False

    def loop(self) -> NoReturn:
        signal.set_wakeup_fd(self.wakeup_w.fileno())
        signal.signal(signal.SIGTERM, lambda *_: None)  # the wakeup fd says it
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # only SIGTERM stops it
        while not (self.stopping and not self.children):
            for key, _ in self.sel.select(self._lease_left()):
                if self.sel.get_map().get(key.fd) is not key:  # unregistered earlier in this pass
                    continue
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is self.wakeup:
                    self.wakeup.recv(4096)
                    self._stop()
                elif key.data == "stdin":
                    self._stdin()
                elif isinstance(key.fileobj, int):
                    self._ended(key.data)
                else:
                    self._client_gone(key.data)
            if self.lease_s is not None and self._lease_left() == 0.0:  # no word from whoever holds it
                self._stdin_gone()
        os._exit(0)

    def _lease_left(self) -> float | None:
        """Seconds until the lease runs out (None: no lease)."""
        if self.lease_s is None:
            return None
        return max(0.0, self.heard + self.lease_s - time.monotonic())

    def _stop(self) -> None:
        """SIGTERM, or the end of a watched stdin: take no more requests; end once the children have
        (their clients stop them)."""
        if not self.stopping:
            self.stopping = True
            self.sel.unregister(self.listener)
            self.listener.close()

    def _stdin(self) -> None:
        """Input on the lease's stdin renews it; its end (the ssh session closed) stops the zygote."""
        if os.read(sys.stdin.fileno(), 4096):
            self.heard = time.monotonic()
        else:
            self._stdin_gone()

    def _stdin_gone(self) -> None:
        self.sel.unregister(sys.stdin.fileno())
        self.lease_s = None
        self._stop()

    def _accept(self) -> None:
        """One client's request: a child for it, or (whatever went wrong) its connection closed, and
        the zygote serves on."""
        try:
            conn, _ = self.listener.accept()
        except OSError as e:  # out of fds, or the client gave up
            _say(f"accept failed: {e!r}")
            return
        try:
            request, fds = _receive(conn)
        except Exception as e:  # a client that died, spoke garbage or is not this user
            _say(f"a request was dropped: {e!r}")
            conn.close()
            return
        try:
            self._fork(conn, request, fds)
        except OSError as e:  # out of processes or memory: the client is told, and fails
            _say(f"could not fork: {e!r}")
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def _fork(self, conn: socket.socket, request: Request, fds: list[int]) -> None:
        # Relayed signals stay blocked across the fork: one sent to the new pid before the child has
        # its own handlers waits for them, instead of running the zygote's.
        old_mask: set[int] = set(signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED))
        zygote = os.getpid()
        try:
            pid = os.fork()
            if pid == 0:
                try:  # never back into the zygote's loop, whatever fails
                    self._as_child(conn)
                    _become(request, fds, old_mask, zygote)
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(1)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        try:
            child = _Child(pid, os.pidfd_open(pid), conn)
        except OSError:  # untracked, it must not run: its client is told it did not start
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        self.children[pid] = child
        self.sel.register(child.pidfd, selectors.EVENT_READ, child)
        self.sel.register(conn, selectors.EVENT_READ, child)
        with contextlib.suppress(OSError):  # a client gone already: its connection says so next
            conn.sendall(f"{pid}\n".encode())
        attempt, rank = request.env.get(ATTEMPT_ENV, "?"), request.env.get("RANK", "?")
        _say(f"forked {pid} (attempt {attempt}, rank {rank}): {shlex.join(request.argv[:3])}")

    def _as_child(self, conn: socket.socket) -> None:
        """In a new child: none of the zygote's sockets, pidfds, selector or signal wakeup."""
        signal.set_wakeup_fd(-1)
        for key in list(self.sel.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
            else:
                os.close(key.fd)
        self.sel.close()
        for sock in (self.listener, self.wakeup_w, conn):  # the listener: gone from the map if stopping
            sock.close()

    def _client_gone(self, child: _Child) -> None:
        """Its client died (or closed): the child goes too, with its process group."""
        assert child.conn is not None
        self.sel.unregister(child.conn)
        child.conn.close()
        child.conn = None
        for kill in (os.killpg, os.kill):  # its group, unless it has not made it yet
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(child.pid, signal.SIGKILL)

    def _ended(self, child: _Child) -> None:
        """The child ended: reap it and tell its client how."""
        ended = os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED | os.WNOHANG)
        if ended is None:
            return
        self.sel.unregister(child.pidfd)
        os.close(child.pidfd)
        del self.children[child.pid]
        if child.conn is not None:
            with contextlib.suppress(OSError):
                child.conn.sendall(f"{_wait_status(ended)}\n".encode())
            self.sel.unregister(child.conn)
            child.conn.close()
            child.conn = None


def _say(line: str) -> None:
    """A line of the zygote's log (stderr): lost, not fatal, once its ssh session is gone."""
    with contextlib.suppress(OSError):
        print(f"gptlaunch.warm: {line}", file=sys.stderr, flush=True)


def serve(
    path: str,
    preload: tuple[str, ...] = PRELOAD,
    optional: tuple[str, ...] = PRELOAD_IF_PRESENT,
    lease_s: float | None = None,
) -> NoReturn:
    """The zygote: import ``preload`` and what it can of ``optional``, make the WARM_CALLS it can, then
    fork a child for each client on the Unix socket ``path`` (a path, mode 0600, whose directory must
    be private to this user; or ``@NAME``, abstract, which the clients' SO_PEERCRED check guards) until
    SIGTERM, or, with ``lease_s``, until stdin ends or brings nothing for that many seconds; then wait
    for the children and exit 0. Never returns; exits 1 when another process holds ``@NAME``
    (``OSError``: address in use)."""
    for module in preload:
        importlib.import_module(module)
    for module in optional:
        with contextlib.suppress(Exception):  # an older torch, or one broken there: the rank imports it
            importlib.import_module(module)
    for module, name in WARM_CALLS:
        with contextlib.suppress(Exception):  # as above: the rank calls it itself
            getattr(importlib.import_module(module), name)()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if not path.startswith("@"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    old_umask = os.umask(0o177)
    try:
        listener.bind(address(path))
    finally:
        os.umask(old_umask)
    listener.listen(64)
    print(f"gptlaunch.warm: ready on {path} (pid {os.getpid()})", flush=True)
    _Zygote(listener, lease_s).loop()


def _receive(conn: socket.socket) -> tuple[Request, list[int]]:
    """A client's request and its fds 0-2 (``gptlaunch.warm``'s protocol). Raises OSError (the
    client went, or is not this user), ValueError (a malformed request)."""
    conn.settimeout(RECEIVE_TIMEOUT_S)
    if peer_uid(conn) != os.getuid():
        raise OSError(f"a client of user {peer_uid(conn)}, not this one's")
    head, fds, _, _ = socket.recv_fds(conn, LENGTH_BYTES, 3)
    try:
        head += _read(conn, LENGTH_BYTES - len(head))
        size = int.from_bytes(head, "big")
        if len(fds) != 3 or not 0 < size <= MAX_REQUEST:
            raise ValueError(f"a request of {size} bytes with {len(fds)} fds")
        fields = json.loads(_read(conn, size))
        request = Request(list(fields["argv"]), dict(fields["env"]), str(fields["cwd"]))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return request, list(fds)


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise OSError("the client closed its connection mid-request")
        data += chunk
    return data


def _wait_status(info: os.waitid_result) -> int:
    """The waitpid-style status of a waitid result (an exit code, or a signal)."""
    if info.si_code == os.CLD_EXITED:
        return (info.si_status & 0xFF) << 8
    return info.si_status & 0x7F  # killed or dumped: the signal


def _become(request: Request, fds: list[int], mask: set[int], zygote: int) -> NoReturn:
    """In the forked child: the client's streams, environment and directory, then the program, as a
    fresh ``python`` would run it. Never returns."""
    for sig in RELAYED:  # the defaults, before the signals blocked across the fork come in
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    _die_with_zygote(zygote)
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # What `ps`, `top` and nvidia-smi show: the program, not the zygote it was forked from (before
    # the environment changes: setproctitle takes over the memory of the environment it started with).
    setproctitle.setproctitle(shlex.join([sys.executable, *request.argv]))
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    _streams(unbuffered=bool(request.env.get("PYTHONUNBUFFERED")))
    _as_started(request.env)
    os._exit(_run_program(request.argv))


def _streams(unbuffered: bool) -> None:
    """New ``sys.std*`` on fds 0-2, as ``python`` makes them (``-u``/PYTHONUNBUFFERED: written
    through; a terminal: by line; stderr: by line, its bad characters escaped)."""

    def text(fd: int, mode: str, through: bool) -> io.TextIOWrapper:
        line = os.isatty(fd) or fd == 2
        errors = "backslashreplace" if fd == 2 else "strict"
        raw = open(fd, mode + "b", buffering=0 if through else -1, closefd=False)  # noqa: SIM115
        return io.TextIOWrapper(raw, errors=errors, line_buffering=line, write_through=through)

    sys.stdin = text(0, "r", through=False)
    sys.stdout = text(1, "w", through=unbuffered)
    sys.stderr = text(2, "w", through=unbuffered)


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


def _run_program(argv: list[str]) -> int:
    """Run ``-m MODULE ARGS`` or ``SCRIPT ARGS`` as ``python`` would; its exit code (a SIGINT
    it did not catch ends this process by SIGINT, as it would end ``python``)."""
    code = 0
    try:
        if argv[:1] == ["-m"]:
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()  # as `python -m` puts its working directory first
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        _shut_down()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130  # SIGINT blocked: as CPython exits then
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _shut_down()
    return code


def _shut_down() -> None:
    """What ``python`` does at its end: wait for the program's non-daemon threads, run its atexit
    functions, flush its streams (the child then leaves by ``os._exit``: none of the zygote's own)."""
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
