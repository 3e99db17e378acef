"""The host side of an SSH job: ``python -m launcher.schedulers.ssh.hostagent run|signal|status``,
started over ssh.

``run --job J --node K -- ARGV`` starts ARGV (the node's torchrun agent) and follows it on its host, so
that the job does not hang on the connection that started it:

- ARGV runs in a process tree this agent tracks: the agent is a child subreaper (orphaned workers
  re-parent to it) and ARGV gets SIGTERM from the kernel if the agent dies. A pid file
  (``<state>/<job>/node-<k>.pid``: pid and create time) finds it again for ``signal``/``status``.
- Output goes to a log on the host (``node-<k>.log``) and to stdout, the agent's channel
  (``launcher.job.channel``): the ssh connection carries it, framed, to the launcher, which writes the
  output into the job record's node log and the node's reports into the record.
- Secret environment variables arrive as one JSON line on stdin (never on a command line or a disk).
- With ``--lease-s L``, the launcher's word keeps the node alive: it writes a byte on stdin every few
  seconds, and when none came for L seconds (a partition, the launcher frozen) or stdin closed (the
  launcher or its connection is gone), the agent kills ARGV's tree at once (SIGKILL: no checkpoint,
  which the job's next attempt may be writing). A launcher that lost a node has already failed or
  replaced it: a node that lost its launcher must not run on beside the next attempt, nor come back
  to life when the link does.
- With ``--nproc-per-node N`` (and the ``--hang-*`` budgets), the hang watchdog follows the ranks'
  heartbeats (``<state>/<job>/node-<k>.heartbeat/``): when none advances within its budget it dumps
  their stacks, sends the report on its channel (``launcher.job.reports.Hang``), keeps the ranks until
  the launcher (with every node's report) stops it or a bound passes, ends ARGV's tree and exits 124
  (``launcher.job.hang.EXIT_HANG``).
- SIGTERM/SIGINT ask ARGV to stop (torchrun forwards it; the ranks checkpoint); SIGHUP is ignored.
  Once ARGV exits, whatever of its tree is left is terminated; the exit code is written to
  ``node-<k>.exit`` and returned.

- With ``--image REF@sha256:… --runtime docker|podman`` (and ``--mount DIR``, ``--env-name NAME``),
  ARGV runs inside a container of the image (``launcher.image.runtime.Container``: the host's
  network, IPC and PID namespaces, the mounts at the same paths, the named variables, the secrets and
  the node's own passed in), named ``gptlaunch-<job>-node<k>``. SIGTERM reaches torchrun through the
  runtime's signal proxy (the ranks checkpoint); however the agent ends (the node done, the lease
  lost, a hang, ``signal KILL``), the container is removed: none is left behind.

``signal --job J --node K --signal TERM|KILL``: TERM asks the node to stop (as above); KILL ends its
whole tree now (TERM, then KILL after ``--grace-s``). ``status``: one JSON line, ``{"running": bool,
"exit_code": int | null}``. Imports no torch: it must start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType

import psutil

from launcher.image.runtime import Container, ImageRun
from launcher.job.channel import Sender
from launcher.job.hang import HangReport, add_watch_flags, parse_with_command, watch_of
from launcher.job.reports import Hang
from launcher.schedulers.ssh.private import UnsafeDirError, private_dir
from launcher.supervisor import procs
from launcher.supervisor.secrets import receive
from launcher.supervisor.watchdog import NodeWatch, Watchdog, end_hung, wait_watching
from trainer.contract import EXIT_FAILED, EXIT_USAGE, HEARTBEAT_DIR_ENV, JOB_ID_ENV, read_beats

NODE_ENV = "GPTLAUNCH_HOST_NODE"  # on every process of a node: tells this node's strays from others'
KILL_GRACE_S = 5.0
# `run`'s channel to the launcher (``launcher.job.channel``): the real stdout, taken by ``_take_stdout``.
_CHANNEL = Sender(1)


def _take_stdout() -> Sender:
    """The channel on a copy of stdout; fd 1 then points at stderr (also the launcher's node log), so
    that no stray write of a library or child lands inside a frame."""
    sender = Sender(os.dup(1))
    os.dup2(2, 1)
    return sender


def state_dir(job_id: str) -> Path:
    """Where this host keeps the node files of ``job_id``: ``$XDG_STATE_HOME/gptlaunch/jobs`` (private
    to the user). Not XDG_RUNTIME_DIR: logind removes that at logout, under a running job."""
    state_home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    path = private_dir(Path(state_home) / "gptlaunch" / "jobs") / job_id
    path.mkdir(exist_ok=True)
    return path


def _files(job_id: str, node: int) -> tuple[Path, Path, Path]:
    base = state_dir(job_id) / f"node-{node}"
    return base.with_suffix(".pid"), base.with_suffix(".exit"), base.with_suffix(".log")


def _heartbeat_dir(job_id: str, node: int) -> Path:
    return state_dir(job_id) / f"node-{node}.heartbeat"


def container_name(job_id: str, node: int) -> str:
    """The name of node ``node``'s container of ``job_id`` on its host."""
    return f"gptlaunch-{job_id}-node{node}"


def run(
    job_id: str,
    node: int,
    argv: list[str],
    watch: NodeWatch | None = None,
    lease_s: float = 0.0,
    image: ImageRun | None = None,
) -> int:
    global _CHANNEL
    _CHANNEL = _take_stdout()
    pid_file, exit_file, _ = _files(job_id, node)
    exit_file.unlink(missing_ok=True)
    secrets = receive()
    assert secrets is not None  # no timeout: read until the line or EOF
    procs.become_subreaper()
    me = psutil.Process()
    # Handlers before the pid file: a stop sent as soon as `signal` can find us must not be lost.
    stop = _Forward()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop.handle)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a dropped connection is not a stop request
    container = None
    if image is not None:  # the node's state dir mounted too: the ranks' heartbeats go there
        container = image.container(container_name(job_id, node), [str(state_dir(job_id))])
    ref: dict[str, object] = {"pid": me.pid, "started": me.create_time()}
    if container is not None:
        ref["container"] = [container.runtime, container.name]
    pid_file.write_text(json.dumps(ref))
    if container is not None:
        container.remove()  # one an earlier attempt on this host left (the agent SIGKILLed with it)
    ours = {JOB_ID_ENV: job_id, NODE_ENV: str(node)}
    watchdog = None
    if watch is not None:
        beats = _heartbeat_dir(job_id, node)
        ours[HEARTBEAT_DIR_ENV] = str(beats)
        watchdog = watch.watchdog(node, socket.gethostname(), beats)
    env = os.environ | secrets | ours
    try:
        if image is not None and container is not None:
            argv = image.argv(container, argv, [*secrets, *ours])
        code = _supervise(job_id, node, argv, env, stop, watchdog, lease_s)
    except OSError as e:  # a mount that cannot be made, a command that cannot start
        _CHANNEL.output(f"hostagent: cannot start {argv[0]!r}: {e.strerror or e}\n".encode())
        code = EXIT_FAILED
    finally:
        if container is not None:  # before the exit file: a next attempt may reuse the name
            container.remove()
    exit_file.write_text(str(code))
    return code


def _supervise(
    job_id: str,
    node: int,
    argv: list[str],
    env: dict[str, str],
    stop: _Forward,
    watchdog: Watchdog | None,
    lease_s: float,
) -> int:
    """Run ``argv`` to its end (see the module docstring); its exit code. Raises OSError when it
    cannot start."""
    log_file = _files(job_id, node)[2]
    me = psutil.Process()
    child = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=procs.die_with_parent,
    )
    stop.follow(child)
    pump = threading.Thread(target=_pump, args=(child, log_file), daemon=True)
    pump.start()
    if lease_s > 0:
        threading.Thread(target=_lease, args=(child, lease_s, log_file), daemon=True).start()
    code, hang = wait_watching(child, watchdog)
    if hang is not None:  # the stacks are taken: say so, keep the ranks until the launcher stops us
        return end_hung(child, hang, lambda found: _report(node, found, log_file), lambda: stop.requested)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # the cleanup below must not be cut short
    # Workers the agent left behind. An agent killed by a signal is a failed node: its orphans must
    # not checkpoint and exit as if asked to stop (the job would look stopped, not failed).
    procs.terminate(me.children(recursive=True), KILL_GRACE_S if code >= 0 else 0.0)
    pump.join(timeout=5)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def _lease(child: subprocess.Popen[bytes], lease_s: float, log_file: Path) -> None:
    """Kill ``child``'s tree once the launcher's word stops: no byte on stdin for ``lease_s`` seconds,
    or stdin closed."""
    fd = sys.stdin.fileno()
    while child.poll() is None:
        if not select.select([fd], [], [], lease_s)[0]:
            why = f"no word from the launcher for {lease_s:.0f} s (the network or the launcher failed)"
        elif not os.read(fd, 4096):
            why = "the connection to the launcher closed"
        else:
            continue
        with open(log_file, "ab") as log:
            log.write(f"hostagent: {why}: ending this node, which the job has failed or replaced\n".encode())
        with contextlib.suppress(psutil.Error):
            procs.signal_all([*psutil.Process(child.pid).children(recursive=True)], signal.SIGKILL)
        child.kill()
        return


def _report(node: int, hang: HangReport, log_file: Path) -> None:
    """The hang: its report on the channel (while it holds), a line saying so in the host log and the
    node log."""
    line = f"{hang.summary()}\n".encode()
    with open(log_file, "ab") as log:
        log.write(line)
    _CHANNEL.report(Hang(node=node, hang=hang, time=hang.time))
    _CHANNEL.output(line)


class _Forward:
    """Relays SIGTERM/SIGINT to the child as SIGTERM, including one that came before it started."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.requested = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def follow(self, child: subprocess.Popen[bytes]) -> None:
        self.child = child
        if self.requested:
            child.send_signal(signal.SIGTERM)


def _pump(child: subprocess.Popen[bytes], log_file: Path) -> None:
    """Copy the child's output to the host log and, while the connection holds, to the channel."""
    assert child.stdout is not None
    with open(log_file, "ab") as log:
        for chunk in iter(lambda: os.read(child.stdout.fileno(), 65536), b""):  # type: ignore[union-attr]
            log.write(chunk)
            log.flush()
            if _CHANNEL.connected:
                _CHANNEL.output(chunk)
                if not _CHANNEL.connected:  # the connection dropped: the output goes on in the host log
                    log.write(b"hostagent: connection to the launcher lost; output goes on here\n")


def _agent(job_id: str, node: int) -> psutil.Process | None:
    pid_file, _, _ = _files(job_id, node)
    try:
        ref = json.loads(pid_file.read_text())
        proc = psutil.Process(int(ref["pid"]))
        if abs(proc.create_time() - float(ref["started"])) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except (OSError, ValueError, KeyError, psutil.Error):
        pass
    return None


def _strays(job_id: str, node: int) -> list[psutil.Process]:
    """Processes of this node of the job that left the agent's tree (by their environment)."""
    return [p for p in procs.job_processes(job_id) if _environ(p).get(NODE_ENV) == str(node)]


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except psutil.Error:
        return {}


def _container(job_id: str, node: int) -> Container | None:
    """The node's container, as its agent recorded it in the pid file (None for a bare node)."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):  # KeyError: a bare node
        runtime, name = json.loads(_files(job_id, node)[0].read_text())["container"]
        return Container(str(runtime), "", str(name))
    return None


def send(job_id: str, node: int, sig: str, grace_s: float) -> int:
    agent = _agent(job_id, node)
    if sig == "TERM":
        if agent is not None:
            procs.signal_all([agent], signal.SIGTERM)
        return 0
    tree = [*agent.children(recursive=True), agent] if agent is not None else []
    # A container's processes carry the node's environment too: found even outside the agent's tree.
    procs.terminate([*tree, *(p for p in _strays(job_id, node) if p not in tree)], grace_s)
    container = _container(job_id, node)
    if container is not None:
        container.remove()
    return 0


def status(job_id: str, node: int) -> dict[str, object]:
    """Whether the node runs, its exit code once it has ended, and its ranks' latest beats."""
    _, exit_file, _ = _files(job_id, node)
    running = _agent(job_id, node) is not None
    code: int | None = None
    if not running and exit_file.is_file():
        code = int(exit_file.read_text().strip() or EXIT_FAILED)
    beats = [dataclasses.asdict(b) for b in read_beats(_heartbeat_dir(job_id, node))]
    return {"running": running, "exit_code": code, "beats": beats}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launcher.schedulers.ssh.hostagent", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("action", choices=["run", "signal", "status"])
    p.add_argument("--job", required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--signal", choices=["TERM", "KILL"], default="TERM")
    p.add_argument("--grace-s", type=float, default=KILL_GRACE_S)
    p.add_argument("--lease-s", type=float, default=0.0, help="run: see the module docstring (0: off)")
    ImageRun.add_flags(p)
    add_watch_flags(p)
    args, command = parse_with_command(p, argv)
    if args.action == "run":
        if not command:
            p.error("run needs the command after --")
        watch = NodeWatch(*found) if (found := watch_of(args)) else None
        return run(args.job, args.node, command, watch, args.lease_s, ImageRun.of(args))
    if command:
        p.error(f"{args.action} takes no command")
    if args.action == "signal":
        return send(args.job, args.node, args.signal, args.grace_s)
    print(json.dumps(status(args.job, args.node)), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UnsafeDirError as e:
        print(f"hostagent: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:
        sys.exit(EXIT_USAGE)
