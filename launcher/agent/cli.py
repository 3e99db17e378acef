"""``python -m launcher.agent run|signal|status|probe|pull``: the node agent on a host the launcher reaches
over ssh (and that may share no file system with it); its flags: ``--help``. Imports no torch: it
starts in a fraction of a second.

``run`` runs the node (``launcher.agent.node.NodeAgent``) so that the job does not hang on the
connection that started it:

- Its stdout is the agent's channel (``launcher.job.channel``): the node's output and its reports,
  framed, which the launcher writes into the job record. The output also goes to a log on the host
  (``node-<k>.log``), where it goes on when the connection drops.
- Its stdin brings the secrets (``launcher.supervisor.transport``), then the lease (``--lease-s``:
  ``NodeAgent._lease``).
- With ``--copy-dir``, on a host that does not see the launcher's ``--mark``: each new checkpoint there
  is reported, for the launcher to copy, and the ``--send-back`` files go back as reports once the
  command ended (``launcher.agent.copies``).
- The reports of the node's processes (``launcher.job.reports.REPORT_DIR_ENV``: ``node-<k>.reports/``)
  are sent on the channel once the command ended, then the agent's last report: a
  ``launcher.job.reports.NodeStatus`` with the exit code and the ranks' last beats.
- A pid file (``<state>/<job>/node-<k>.pid``: pid, create time, the container) finds the agent again
  for ``signal`` and ``status``; the exit code goes to ``node-<k>.exit``. The ranks beat in
  ``node-<k>.heartbeat/`` there. ``--state-dir DIR`` puts these files in DIR instead: an agent that is
  a child of the launcher on the same machine (the local scheduler) keeps them in the job record, and
  writes no host log (its channel cannot drop; the launcher keeps the node log).

``signal``: TERM asks the node to stop (the ranks checkpoint); KILL ends its whole tree now (TERM, then
KILL after ``--grace-s``) and removes its container. ``status``, ``probe`` (this host, before there is
a job: ``launcher.preflight.probe``) and ``pull`` (the image) answer with one report on stdout, framed
as on ``run``'s channel (``NodeStatus``, ``Probed``, ``Pulled``); a pull that fails prints the
runtime's error on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from gptlaunch.contract import EXIT_FAILED, EXIT_USAGE, JOB_ID_ENV, read_beats
from launcher.agent.copies import MARK, CheckpointWatch, send_back, shares_files
from launcher.agent.node import KILL_GRACE_S, NodeAgent
from launcher.agent.private import UnsafeDirError, private_dir
from launcher.image.runtime import Container, ContainerError, ImageRun, pick, pull
from launcher.job.channel import Sender
from launcher.job.hang import HangSpec, add_watch_flags, parse_with_command, watch_of
from launcher.job.plan import container_name
from launcher.job.reports import NodeStatus, Probed, Pulled
from launcher.job.torchrun import zygote_serve
from launcher.preflight.probe import collect
from launcher.supervisor import procs
from launcher.supervisor.transport import receive_secrets

NODE_ENV = "GPTLAUNCH_HOST_NODE"  # on every process of a node: tells this node's strays from others'


def state_dir(job_id: str) -> Path:
    """Where this host keeps the node files of ``job_id``: ``$XDG_STATE_HOME/gptlaunch/jobs`` (private
    to the user). Not XDG_RUNTIME_DIR: logind removes that at logout, under a running job."""
    state_home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    path = private_dir(Path(state_home) / "gptlaunch" / "jobs") / job_id
    path.mkdir(exist_ok=True)
    return path


@dataclass(frozen=True)
class Back:
    """``run --copy-dir DIR [--copy-exclude SUB]... --send-back PATH... --mark FILE``: the node's
    checkpoint dir, watched, and the files sent back once its command ended. The launcher marks the
    job record (``mark``) and the checkpoint dir (``MARK`` in it): a host that sees a mark shares that
    dir with the launcher, which reads it itself."""

    copy_dir: Path
    exclude: tuple[str, ...]
    files: list[Path]
    mark: Path

    def watch(self, job_id: str, node: int, channel: Sender) -> CheckpointWatch | None:
        if shares_files(self.copy_dir / MARK, job_id):
            return None
        watch = CheckpointWatch(self.copy_dir, node, socket.gethostname(), channel.report, self.exclude)
        watch.start()
        return watch

    def finish(self, job_id: str, node: int, channel: Sender, watch: CheckpointWatch | None) -> None:
        """The last save reported, then the files the launcher cannot see sent back."""
        if watch is not None:
            watch.finish()
        copy_dir_seen = shares_files(self.copy_dir / MARK, job_id)
        record_seen = shares_files(self.mark, job_id)
        unseen = [
            f for f in self.files if not (copy_dir_seen if f.is_relative_to(self.copy_dir) else record_seen)
        ]
        send_back(unseen, node, channel.report)

    @classmethod
    def of(cls, args: argparse.Namespace) -> Back | None:
        if args.copy_dir is None:
            return None
        return cls(args.copy_dir, tuple(args.copy_exclude), args.send_back, args.mark)


def _files(where: Path, node: int) -> tuple[Path, Path, Path]:
    base = where / f"node-{node}"
    return base.with_suffix(".pid"), base.with_suffix(".exit"), base.with_suffix(".log")


def _heartbeat_dir(where: Path, node: int) -> Path:
    return where / f"node-{node}.heartbeat"


def _take_stdout() -> Sender:
    """The channel on a copy of stdout; fd 1 then points at stderr (also the launcher's node log), so
    that no stray write of a library or child lands inside a frame."""
    sender = Sender(os.dup(1))
    os.dup2(2, 1)
    return sender


def run(
    job_id: str,
    node: int,
    argv: list[str],
    watch: tuple[HangSpec, int] | None,
    lease_s: float,
    image: ImageRun | None,
    heartbeat_dir: Path | None = None,
    where: Path | None = None,
    back: Back | None = None,
) -> int:
    """``run`` (see the module docstring; ``where``: ``--state-dir``): the node's exit code."""
    channel = _take_stdout()
    base = where or state_dir(job_id)
    base.mkdir(parents=True, exist_ok=True)
    pid_file, exit_file, log_file = _files(base, node)
    exit_file.unlink(missing_ok=True)
    secrets = receive_secrets()
    assert secrets is not None  # no timeout: read until the line or EOF
    ours = {JOB_ID_ENV: job_id, NODE_ENV: str(node)}
    beats = heartbeat_dir or _heartbeat_dir(base, node)
    forward = log_file.with_suffix(".reports")  # an earlier run's are not this one's
    shutil.rmtree(forward, ignore_errors=True)
    forward.mkdir()
    with open(log_file if where is None else os.devnull, "ab") as log:

        def sink(chunk: bytes) -> None:
            log.write(chunk)
            log.flush()
            if channel.connected:
                channel.output(chunk)
                if not channel.connected:  # the connection dropped: the output goes on in the host log
                    log.write(b"agent: connection to the launcher lost; output goes on here\n")

        agent = NodeAgent(
            node=node,
            argv=argv,
            env=os.environ | secrets | ours,
            report=channel.report,
            say=lambda line: sink(f"{line}\n".encode()),
            watch=watch,
            heartbeat_dir=str(beats) if watch is not None else None,
            image=image,
            container_name=container_name(job_id, node),
            container_mounts=[str(pid_file.parent), str(beats)],  # the ranks' heartbeats go there
            env_names=[*secrets, *ours],
            sink=sink,
            lease_s=lease_s,
            lease_fd=sys.stdin.fileno(),
            forward_dir=str(forward),
        )
        agent.install_signals()  # before the pid file: a stop sent as soon as `signal` finds us counts
        ref = procs.process_ref().model_dump(exclude={"host"})
        if image is not None:
            ref["container"] = [image.runtime, container_name(job_id, node)]
        pid_file.write_text(json.dumps(ref))
        checkpoints = back.watch(job_id, node, channel) if back is not None else None
        try:
            code = agent.run()
        except OSError as e:  # a mount that cannot be made, a command that cannot start
            sink(f"agent: cannot start {argv[0]!r}: {e.strerror or e}\n".encode())
            code = EXIT_FAILED
        if back is not None:
            back.finish(job_id, node, channel, checkpoints)
        # Its last word: the node has ended (nothing of its tree runs: ``NodeAgent.run``), with the
        # ranks' last beats. The launcher then neither signals this node nor asks for its beats again.
        channel.report(NodeStatus(node=node, running=False, exit_code=code, beats=read_beats(beats)))
    exit_file.write_text(str(code))
    return code


def _agent(where: Path, node: int) -> psutil.Process | None:
    pid_file, _, _ = _files(where, node)
    with contextlib.suppress(OSError, ValueError, KeyError, psutil.Error):
        ref = json.loads(pid_file.read_text())
        proc = psutil.Process(int(ref["pid"]))
        if abs(proc.create_time() - float(ref["started"])) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    return None


def _forked(job_id: str) -> list[psutil.Process]:
    """Ranks that the job's zygote on this host forked (warm workers on ssh): its children. The
    zygote is ``python`` and ``zygote_serve`` (not the processes that only name its socket: the
    agent, torchrun and the clients) in this process's network namespace, where its abstract socket
    is: hosts emulated on one machine (the dev hosts) share a process table, not that namespace."""
    serve, here = zygote_serve(job_id), _net_namespace(os.getpid())
    found: list[psutil.Process] = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.cmdline()[1:5] == serve and _net_namespace(proc.pid) == here:
                found += proc.children()
    return found


def _net_namespace(pid: int) -> int:
    """The inode of ``pid``'s network namespace. Raises OSError when it cannot be read (it ended)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _container(where: Path, node: int) -> Container | None:
    """The node's container, as its agent recorded it in the pid file (None for a bare node)."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):  # KeyError: a bare node
        runtime, name = json.loads(_files(where, node)[0].read_text())["container"]
        return Container(str(runtime), "", str(name))
    return None


def send(job_id: str, where: Path, node: int, sig: str, grace_s: float) -> None:
    agent = _agent(where, node)
    if sig == "TERM":
        if agent is not None:
            procs.signal_all([agent], signal.SIGTERM)
        return
    tree = [*agent.children(recursive=True), agent] if agent is not None else []
    # Processes of this node that left the agent's tree are found by their environment (a container's
    # carry the node's too); and ranks forked by the job's zygote (--warm-workers) are its children:
    # the node is gone once they are too.
    strays = procs.job_processes(job_id, {NODE_ENV: str(node)})
    outside = [p for p in [*strays, *_forked(job_id)] if p not in tree]
    procs.terminate([*tree, *outside], grace_s)
    container = _container(where, node)
    if container is not None:
        container.remove()


def status(where: Path, node: int) -> NodeStatus:
    """Whether the node runs, its exit code once it has ended, and its ranks' latest beats."""
    _, exit_file, _ = _files(where, node)
    running = _agent(where, node) is not None
    code: int | None = None
    if not running and exit_file.is_file():
        code = int(exit_file.read_text().strip() or EXIT_FAILED)
    return NodeStatus(
        node=node, running=running, exit_code=code, beats=read_beats(_heartbeat_dir(where, node))
    )


def _pull(node: int, runtime: str, image: str | None) -> int:
    """``pull``: a ``Pulled`` report, or the registry's (or the runtime's) error on stderr, exit 1."""
    if not image:
        print("agent: error: pull needs --image", file=sys.stderr, flush=True)
        return EXIT_USAGE
    channel = _take_stdout()
    try:
        picked = pick(runtime)
        channel.report(Pulled(node=node, runtime=picked, seconds=round(pull(picked, image), 3)))
    except ContainerError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launcher.agent", description="The node agent of a job's node."
    )
    p.add_argument("action", choices=["run", "signal", "status", "probe", "pull"])
    p.add_argument("--job", help="the job's id (all but probe and pull)")
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--signal", choices=["TERM", "KILL"], default="TERM")
    p.add_argument("--grace-s", type=float, default=KILL_GRACE_S)
    p.add_argument("--lease-s", type=float, default=0.0, help="run: see the module docstring (0: off)")
    p.add_argument("--heartbeat-dir", type=Path, help="run: where the ranks beat (default: the state dir)")
    p.add_argument("--state-dir", type=Path, help="the agent's files (default: the user's state dir)")
    p.add_argument(
        "--copy-dir",
        type=Path,
        help="run: the checkpoint dir, copied by a launcher that does "
        "not see this host's files (see launcher.agent.copies)",
    )
    p.add_argument(
        "--copy-exclude",
        action="append",
        default=[],
        metavar="SUB",
        help="run: a dir below --copy-dir that is not copied (repeatable)",
    )
    p.add_argument(
        "--send-back",
        type=Path,
        action="append",
        default=[],
        help="run: a file or dir sent back to such a launcher once the command ended (repeatable)",
    )
    p.add_argument(
        "--mark",
        type=Path,
        help="run, with --copy-dir: the launcher's mark in the job record "
        f"({MARK}); a host that sees it shares the launcher's files",
    )
    p.add_argument("--route-to", metavar="HOST", help="probe: also the route (interface) to HOST")
    p.add_argument("--resolve", metavar="NAME", action="append", default=[], help="probe: what NAME is")
    p.add_argument("--free-port", action="store_true", help="probe: a free TCP port on this host")
    ImageRun.add_flags(p)
    add_watch_flags(p)
    args, command = parse_with_command(p, argv)
    if args.action == "probe":
        channel = _take_stdout()  # first: what the probe's imports print goes to stderr
        channel.report(Probed(node=args.node, probe=collect(args.route_to, args.resolve, args.free_port)))
        return 0
    if args.action == "pull":
        return _pull(args.node, args.runtime, args.image)
    if args.job is None:
        p.error(f"{args.action} needs --job")
    if args.action == "run":
        if not command:
            p.error("run needs the command after --")
        if args.copy_dir is not None and args.mark is None:
            p.error("--copy-dir needs --mark")
        image = ImageRun.of(args)
        return run(
            args.job, args.node, command, watch_of(args), args.lease_s, image,
            heartbeat_dir=args.heartbeat_dir, where=args.state_dir, back=Back.of(args),
        )  # fmt: skip
    if command:
        p.error(f"{args.action} takes no command")
    where = args.state_dir or state_dir(args.job)
    if args.action == "signal":
        send(args.job, where, args.node, args.signal, args.grace_s)
    # After a KILL the node is gone: its last status now, so no one asks again.
    if args.action == "status" or args.signal == "KILL":
        _take_stdout().report(status(where, args.node))
    return 0


def entry() -> None:
    try:
        sys.exit(main())
    except UnsafeDirError as e:
        print(f"agent: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:
        sys.exit(EXIT_USAGE)
