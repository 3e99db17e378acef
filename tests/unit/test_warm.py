"""Workers forked from a warm process (``gptlaunch.warm``), with real processes: the child runs the
program with the client's argv, environment, directory and streams; the client ends as the child
ended (its code, or its signal), relays signals to it, and takes the child with it when killed; with
no zygote the client runs the program itself."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gptlaunch.warm import address
from launcher.agent.cli import _forked
from launcher.job.torchrun import zygote_name, zygote_serve

PROGRAM = """
import os, signal, sys, time
got = []
if sys.argv[1] == "wait":  # before the line the test waits for
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
print("argv", sys.argv[1:], "env", os.environ.get("WARM_TEST"), "cwd", os.getcwd(), flush=True)
print("pid", os.getpid(), flush=True)
what = sys.argv[1]
if what == "exit":
    import atexit
    atexit.register(print, "atexit ran", flush=True)
    sys.exit(int(sys.argv[2]))
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "raise":
    raise RuntimeError("boom")
if what == "wait":
    while not got:
        time.sleep(0.05)
    print("got", got[0], flush=True)
"""


@pytest.fixture
def socket_path() -> Iterator[str]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # a Unix socket's path is at most 107 bytes
        yield str(Path(d) / "z.sock")


@pytest.fixture
def zygote(socket_path: str) -> Iterator[subprocess.Popen[str]]:
    code = f"from gptlaunch.warm.zygote import serve; serve({socket_path!r}, ('json',), ())"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and "ready" in proc.stdout.readline()
    yield proc
    proc.terminate()
    proc.wait(10)


def _client(
    socket_path: str, program: Path, *args: str, cwd: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "gptlaunch.warm", "run", socket_path, "--", str(program), *args]
    env = os.environ | {"WARM_TEST": "from-client", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env |= extra_env or {}
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def program(tmp_path: Path) -> Path:
    path = tmp_path / "program.py"
    path.write_text(PROGRAM)
    return path


def test_the_child_runs_with_the_clients_argv_environment_directory_and_exit_code(
    zygote, socket_path: str, program: Path, tmp_path: Path
) -> None:
    client = _client(socket_path, program, "exit", "3", cwd=tmp_path)
    out, err = client.communicate(timeout=30)
    assert client.returncode == 3, err
    assert f"argv ['exit', '3'] env from-client cwd {tmp_path}\n" in out
    assert out.endswith("atexit ran\n")  # the program's end, as python ends it
    assert int(out.split("pid ")[1].split()[0]) not in (client.pid, zygote.pid)  # a fork of the zygote


def test_a_child_killed_by_a_signal_ends_its_client_by_the_same_signal(
    zygote, socket_path: str, program: Path, tmp_path: Path
) -> None:
    client = _client(socket_path, program, "kill", cwd=tmp_path)
    client.communicate(timeout=30)
    assert client.returncode == -signal.SIGKILL


def test_an_exception_in_the_child_is_its_traceback_and_exit_1(
    zygote, socket_path: str, program: Path, tmp_path: Path
) -> None:
    client = _client(socket_path, program, "raise", cwd=tmp_path)
    _, err = client.communicate(timeout=30)
    assert client.returncode == 1 and "RuntimeError: boom" in err


def _child_pid(client: subprocess.Popen[str]) -> int:
    assert client.stdout is not None
    client.stdout.readline()  # argv, env, cwd
    return int(client.stdout.readline().split()[1])


def test_sigterm_to_the_client_reaches_the_child(
    zygote, socket_path: str, program: Path, tmp_path: Path
) -> None:
    client = _client(socket_path, program, "wait", cwd=tmp_path)
    _child_pid(client)
    client.send_signal(signal.SIGTERM)
    out, err = client.communicate(timeout=30)
    assert client.returncode == 0 and f"got {int(signal.SIGTERM)}" in out, err


def test_a_killed_client_takes_its_child_with_it(
    zygote, socket_path: str, program: Path, tmp_path: Path
) -> None:
    client = _client(socket_path, program, "wait", cwd=tmp_path)
    child = _child_pid(client)
    client.kill()
    client.wait(10)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child outlived its client"
        time.sleep(0.05)


def test_without_a_zygote_the_client_runs_the_program_itself(
    socket_path: str, program: Path, tmp_path: Path
) -> None:
    client = _client(socket_path, program, "exit", "4", cwd=tmp_path)
    out, _ = client.communicate(timeout=30)
    assert client.returncode == 4 and f"pid {client.pid}" in out  # exec'd in place: the same process


def test_a_killed_zygote_takes_its_children_with_it_and_ps_shows_the_program(
    zygote, socket_path: str, program: Path, tmp_path: Path
) -> None:
    client = _client(socket_path, program, "wait", cwd=tmp_path)
    child = psutil.Process(_child_pid(client))
    # Not the zygote's command line (a title: one string, which psutil may not split)
    assert " ".join(child.cmdline()).split() == [sys.executable, str(program), "wait"]
    zygote.kill()
    zygote.wait(10)
    psutil.wait_procs([child], timeout=10)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    client.wait(10)
    assert client.returncode == 1  # its client fails: torchrun sees a failed rank


def test_a_client_that_dies_mid_request_does_not_take_the_zygote_down_and_big_requests_arrive_whole(
    zygote, socket_path: str, program: Path, tmp_path: Path
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as half:
        half.connect(socket_path)
        half.sendall(b"\x00\x00\x00\x00\x00\x01\x00\x00{")  # 64 KiB announced, 1 byte sent, then gone
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as garbage:  # whole, with fds, but not a request
        garbage.connect(socket_path)
        socket.send_fds(garbage, [(2).to_bytes(8, "big") + b"[]"], [0, 1, 2])
        assert garbage.recv(100) == b""  # dropped: closed without a pid
    big = {f"WARM_BIG_{i}": "x" * 60_000 for i in range(4)}  # several socket buffers' worth
    client = _client(socket_path, program, "exit", "5", cwd=tmp_path, extra_env=big)
    out, err = client.communicate(timeout=30)
    assert client.returncode == 5 and "env from-client" in out, err
    assert zygote.poll() is None


def test_a_stop_sent_as_the_rank_starts_is_never_taken_for_success(
    zygote, socket_path: str, program: Path, tmp_path: Path
) -> None:
    """SIGTERM at once, before the client knows its child: relayed once it does, the child dies of it
    (or its program's handler gets it): never the zygote's own handler, which exits 0."""
    for _ in range(10):
        client = _client(socket_path, program, "wait", cwd=tmp_path)
        client.send_signal(signal.SIGTERM)
        out, err = client.communicate(timeout=30)
        assert client.returncode == -signal.SIGTERM or f"got {int(signal.SIGTERM)}" in out, (out, err)


def test_a_stopped_zygote_waits_for_its_children_then_exits(
    zygote, socket_path: str, program: Path, tmp_path: Path
) -> None:
    client = _client(socket_path, program, "wait", cwd=tmp_path)
    _child_pid(client)
    zygote.terminate()  # as when the supervisor dies: the ranks' own stop comes through their clients
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.wait(1)  # bounded: it must still be there while its child runs
    assert _client(socket_path, program, "exit", "0", cwd=tmp_path).wait(30) == 0  # cold: no listener
    client.send_signal(signal.SIGTERM)
    assert client.wait(30) == 0
    assert zygote.wait(30) == 0


def _leased_zygote(name: str, lease_s: float) -> subprocess.Popen[str]:
    code = f"from gptlaunch.warm.zygote import serve; serve({name!r}, ('json',), (), lease_s={lease_s})"
    zygote = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert zygote.stdout is not None and "ready" in zygote.stdout.readline()
    return zygote


def test_an_abstract_zygote_serves_its_clients_holds_its_name_and_stops_when_its_stdin_ends(
    program: Path, tmp_path: Path
) -> None:
    """The SSH scheduler's zygote: ``@NAME`` (no file; per network namespace), alive as long as its
    stdin (its ssh session) is open."""
    name = f"@gptlaunch-warm-test-{os.getpid()}-{time.monotonic_ns()}"
    zygote = _leased_zygote(name, 600.0)
    try:
        code = f"from gptlaunch.warm.zygote import serve; serve({name!r}, ('json',), ())"
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        assert other.returncode == 1 and "Address already in use" in other.stderr  # the name is held
        client = _client(name, program, "exit", "3", cwd=tmp_path)
        out, err = client.communicate(timeout=30)
        assert client.returncode == 3 and f"cwd {tmp_path}" in out, err
        assert int(out.split("pid ")[1].split()[0]) != client.pid  # forked, not run cold
        assert zygote.poll() is None
        assert zygote.stdin is not None
        zygote.stdin.close()
        assert zygote.wait(30) == 0
    finally:
        zygote.kill()
        zygote.wait()
    cold = _client(name, program, "exit", "0", cwd=tmp_path)
    out, _ = cold.communicate(timeout=30)
    assert cold.returncode == 0 and f"pid {cold.pid}" in out  # nobody serves the name any more


def test_a_zygote_whose_lease_is_not_renewed_stops_but_its_running_child_ends_first(
    program: Path, tmp_path: Path
) -> None:
    """A host cut off from the supervisor: nothing more comes on the zygote's stdin, which stays open.
    The zygote stops taking requests once its lease (1 s here) runs out, and exits once its child,
    stopped through its client, has ended."""
    name = f"@gptlaunch-warm-test-{os.getpid()}-{time.monotonic_ns()}"
    zygote = _leased_zygote(name, 1.0)
    try:
        client = _client(name, program, "wait", cwd=tmp_path)
        _child_pid(client)  # forked before the lease ran out (or the test fails: it reads no pid)
        deadline = time.monotonic() + 30
        while not _listening_ended(name):  # its listener closes as the lease runs out
            assert time.monotonic() < deadline, "the zygote took requests 30 s after its lease ran out"
            time.sleep(0.05)
        assert zygote.poll() is None  # its child still runs
        client.send_signal(signal.SIGTERM)
        assert client.wait(30) == 0
        assert zygote.wait(30) == 0
    finally:
        zygote.kill()
        zygote.wait()


def _listening_ended(name: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(address(name))
        except ConnectionRefusedError:
            return True
    return False


def test_a_nodes_kill_finds_the_ranks_its_jobs_zygote_forked_and_nothing_that_only_names_it(
    program: Path, tmp_path: Path
) -> None:
    """``launcher.agent signal KILL``'s zygote children (SSH): those of the process started as the
    job's zygote (``zygote_serve``), not those of a process whose command line names its socket (a
    node's agent and torchrun do), nor another job's."""
    job = f"test-{os.getpid()}-{time.monotonic_ns()}"
    zygote = subprocess.Popen([sys.executable, *zygote_serve(job)], stdout=subprocess.PIPE, text=True)
    naming = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:3])",
                               "sleep", "60", zygote_name(job)])  # fmt: skip
    try:
        assert zygote.stdout is not None and "ready" in zygote.stdout.readline()
        client = _client(zygote_name(job), program, "wait", cwd=tmp_path)
        child = _child_pid(client)
        deadline = time.monotonic() + 10
        while not psutil.Process(naming.pid).children():  # its child: what the old match also took
            assert time.monotonic() < deadline, "the process that names the socket started no child"
            time.sleep(0.05)
        assert [p.pid for p in _forked(job)] == [child]
        assert _forked(f"{job}-other") == []
        client.send_signal(signal.SIGTERM)
        assert client.wait(30) == 0
    finally:
        for proc in (naming, zygote):
            for descendant in psutil.Process(proc.pid).children(recursive=True):
                descendant.kill()
            proc.kill()
            proc.wait()
