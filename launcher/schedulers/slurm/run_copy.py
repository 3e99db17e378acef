"""SLURM nodes whose run dir is node-local (a local NVMe, ``/tmp``: not the file system the nodes
share): in front of its torchrun (``main``), each node's task restores the run dir's copy in the job
record (``JOB/run-copy``, ``RUN_COPY``) before its ranks start, then copies each save into it, off the
ranks' critical path; so a checkpoint survives the loss of a node, and the stop marker reaches the
launcher. What a user sees of it (which run dirs are node-local, ``.not-in-copy``, never a silent
restart): docs/schedulers/slurm.md, "A run dir on each node's own disk".

Why the job record keeps the second copy: it is the one place that every node of the next attempt and
the launcher's machine can read (the job cannot run without it), and no launcher need be alive during
a SLURM job, so the nodes copy for themselves; a peer node's disk is one more node that can be lost,
and SLURM gives a task no login to its peers. Every node restores, not only rank 0's: c10d places rank
0 on any node, a node that replaces an excluded one has nothing, and the rendezvous waits for every
node, so no rank starts before its node holds the checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from gptlaunch.contract import EXIT_REFUSED, STOP_MARKER
from launcher.agent.copies import MARK, CheckpointWatch, Snapshot, absent, shares_files, snapshot, write_mark
from launcher.job import reports
from launcher.job.console import say
from launcher.job.failures import RUN_COPY
from launcher.job.hang import parse_with_command
from launcher.job.plan import Plan
from launcher.job.reports import NodeReport, Saved
from launcher.supervisor import procs

NOT_IN_COPY = ".not-in-copy"  # below the run dir (hidden: never copied): files a restore set aside


def node_local(run_dir: Path, job_id: str, declared: bool | None) -> bool:
    """Whether ``run_dir`` is node-local: as ``declared``, or (None) when this node does not see the
    launcher's mark of ``job_id`` in it; never without both (the standalone sbatch script)."""
    if declared is not None:
        return declared
    return bool(job_id) and not shares_files(run_dir / MARK, job_id)


def mark_run_dir(plan: Plan, declared: bool | None) -> bool | None:
    """At submit, for a run dir not ``declared`` shared or node-local: the launcher's mark in it (a
    node that does not see it has a node-local run dir). One that cannot be written is taken as
    shared (False), with a warning. Returns what the nodes are told."""
    if declared is not None:
        return declared
    try:
        write_mark(Path(plan.run_dir), plan.job_id)
    except OSError as e:  # no mark: every node would take a shared run dir for its own disk
        say(
            f"launcher: warning: cannot write the launcher's mark in the run dir ({e}): taken as "
            "shared by the nodes; if it is on each node's own disk, say --node-local-run-dir"
        )
        return False
    return None


def copy_file(source: Path, target: Path) -> bool:
    """``source`` to ``target`` (its dir made), all or nothing: a temporary name, then renamed into
    place; the mtime is kept, which ``absent`` compares. False, and nothing copied, when ``source``
    changed meanwhile (a torn copy would pass for the save). Raises OSError."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        before = _version(source)
        shutil.copy2(source, partial)
        if _version(source) != before:
            return False
        os.replace(partial, target)
        return True
    finally:
        partial.unlink(missing_ok=True)


def _stale(here: tuple[int, int, int] | None, copy: tuple[int, int, int]) -> bool:
    """Whether the copy's version (inode, bytes, mtime in ns) replaces ``here``, the run dir's: none
    there, an older one, or one of the same mtime and another size (rsync's ``--update``). A newer one
    stays: a survivor's logs of the steps past the copy's checkpoint, which a retry resuming from the
    snapshot in its memory does not redo (the copy keeps the mtimes of the node that saved it)."""
    return here is None or here[2] < copy[2] or (here[2] == copy[2] and here[1] != copy[1])


def _version(path: Path) -> tuple[int, int, int]:
    info = path.stat()
    return info.st_ino, info.st_size, info.st_mtime_ns


class RunCopy:
    """The copy of node ``node``'s (on ``host``) run dir ``run_dir`` in the job record ``job_dir``;
    ``exclude``: dirs below the run dir that are not copied (the trainer's prepared data: each node
    makes its own). ``say``: a line for the node's log."""

    def __init__(
        self,
        job_dir: Path,
        run_dir: Path,
        node: int,
        host: str,
        say: Callable[[str], None],
        exclude: tuple[str, ...] = (),
    ) -> None:
        self.job_dir, self.run_dir, self.node, self.host, self.say = job_dir, run_dir, node, host, say
        self.copy = job_dir / RUN_COPY
        self._copied: Snapshot = {}  # this node's files as last copied (or restored): what is not news
        self._watch = CheckpointWatch(run_dir, node, host, self._saved, exclude)
        self._finishing = False

    def refusal(self) -> str | None:
        """Why the ranks must not start here: the newest checkpoint a node of this job saved is not in
        the copy (None when it is, or none was saved)."""
        saved = reports.read(self.job_dir, Saved)
        newest = max(saved, key=lambda r: r.time) if saved else None
        if newest is None or not (files := absent(newest, self.copy)):
            return None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newest.time))
        return (
            f"the newest checkpoint ({', '.join(files[:3])}) was saved on {newest.host} (node "
            f"{newest.node}) at {when} in its own run dir {newest.directory}, and is not in its copy "
            f"{self.copy} (that node was lost before the copy, or the copy failed: see its log); to "
            f"resume from it, copy it from {newest.host} into the same run dir on every node of the next "
            "job (or into a shared --run-dir) and submit again, or let a retry go on from the copy's "
            "older checkpoint with --allow-start-over"
        )

    def restore(self) -> None:
        """The copy into the run dir: each file that is missing there or older there (``_stale``).
        Once this job saved, the files of the run dir that are not in the copy (a save this node made
        but never copied, having been lost) go aside into ``NOT_IN_COPY``: every node then starts from
        the same files, and rank 0 cannot pick a checkpoint that its peers lack. Raises OSError."""
        here, there = snapshot(self.run_dir, self._watch.exclude), snapshot(self.copy)
        copied = [name for name, info in there.items() if _stale(here.get(name), info)]
        for name in copied:
            copy_file(self.copy / name, self.run_dir / name)
        aside = sorted(set(here) - set(there)) if reports.read(self.job_dir, Saved) else []
        for name in aside:
            target = self.run_dir / NOT_IN_COPY / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # gone meanwhile
                os.replace(self.run_dir / name, target)
        if copied or aside:
            moved = f"; {len(aside)} not in it moved to {self.run_dir / NOT_IN_COPY}" if aside else ""
            self.say(f"task: restored {len(copied)} file(s) of the run dir from its copy {self.copy}{moved}")

    def start(self) -> None:
        """Copy each save from now on (the files already here were restored, or are older)."""
        self._copied = snapshot(self.run_dir, self._watch.exclude)
        self._watch.start(known=self._copied)

    def finish(self) -> None:
        """Once the ranks ended: copy what they saved last (the files have settled), and stop. Once:
        a second call (SLURM's warning, handled while the first runs) returns at once."""
        if not self._finishing:
            self._finishing = True
            self._watch.finish()

    def _saved(self, report: NodeReport) -> None:
        """A save: recorded first (a node lost during the copy leaves a save the copy lacks, which the
        next attempt refuses to pass over), then copied. A failure is said and left: the next save
        tries again, and the next attempt names a save that never reached the copy."""
        if not isinstance(report, Saved):
            return
        try:
            reports.append(self.job_dir, report)
            self._copy(report)
        except Exception as e:
            self.say(f"task: the copy of the run dir's save into {self.copy} failed: {e}")

    def _copy(self, report: Saved) -> None:
        """The files of ``report`` this node changed since it last copied (an appended log comes with
        the save; what it restored and never touched is not pushed back over a newer copy), the stop
        marker last: once a reader sees it, the checkpoint it names is in the copy. A file this node
        removed (a rotated checkpoint) leaves the copy too."""
        started, size = time.monotonic(), 0
        now = snapshot(self.run_dir, self._watch.exclude)
        copied = dict(self._copied)
        for name in sorted(report.files, key=lambda name: name == STOP_MARKER):
            changed = name in now and now[name] != self._copied.get(name)
            if changed and copy_file(self.run_dir / name, self.copy / name):
                copied[name] = now[name]
                size += now[name][1]
        for gone in set(self._copied) - set(now):
            with contextlib.suppress(FileNotFoundError):
                (self.copy / gone).unlink()
            copied.pop(gone, None)
        self._copied = copied
        took = time.monotonic() - started
        saved = ", ".join(sorted(report.changed)[:3])
        self.say(
            f"task: run dir copy: {saved}: {size / 1e6:.1f} MB in {took:.1f} s "
            f"({size / 1e6 / max(took, 1e-3):.0f} MB/s) into {self.copy}"
        )


def wrapper_argv(
    python: str, job_dir: Path, run_dir: str, node: int, job_id: str, declared: bool | None,
    exclude: Sequence[str], allow_start_over: bool,
) -> list[str]:  # fmt: skip
    """``python -m launcher.schedulers.slurm.run_copy``'s flags for node ``node`` (``main``) and the
    ``--`` before its command, in front of it unless the run dir is ``declared`` shared (none)."""
    if declared is False:
        return []
    return [
        *(python, "-m", "launcher.schedulers.slurm.run_copy", "--job-dir", str(job_dir)),
        *("--run-dir", run_dir, "--node", str(node), "--job-id", job_id),
        *(["--node-local-run-dir"] if declared else []),
        *(f"--copy-exclude={sub}" for sub in exclude),
        *(["--allow-start-over"] if allow_start_over else []),
        "--",
    ]


def main(argv: list[str] | None = None) -> int:
    """A node's command under the controller (``--slurm-controller``), its run dir kept in the job
    record when it is node-local: the copy restored first (or the start refused: exit 3), each save
    copied while COMMAND runs, the last and the stop marker once it ended; its exit code. With a
    shared run dir, COMMAND in this process's place."""
    p = argparse.ArgumentParser(prog="python -m launcher.schedulers.slurm.run_copy")
    p.add_argument("--job-dir", type=Path, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--node-local-run-dir", dest="declared", action="store_true", default=None)
    p.add_argument("--shared-run-dir", dest="declared", action="store_false")
    p.add_argument("--copy-exclude", action="append", default=[])
    p.add_argument("--allow-start-over", action="store_true")
    args, command = parse_with_command(p, argv)
    if not node_local(args.run_dir, args.job_id, args.declared):
        os.execvp(command[0], command)
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    copy = RunCopy(args.job_dir, args.run_dir, args.node, host, _say, tuple(args.copy_exclude))
    why = copy.refusal()
    if why is not None and not args.allow_start_over:
        refused = reports.Refused(node=args.node, check="checkpoint", exit_code=EXIT_REFUSED, message=why)
        reports.append(args.job_dir, refused)
        _say(f"task: not started: {why}")
        return EXIT_REFUSED
    if why is not None:
        _say(f"task: warning: going on from an older checkpoint (--allow-start-over): {why}")
    copy.restore()
    copy.start()
    agent = os.getppid()
    children: list[subprocess.Popen[bytes]] = []
    asked: list[int] = []  # a stop that came before the child started

    def stop(signum: int, frame: FrameType | None) -> None:
        if os.getppid() != agent:
            # The agent died (the kernel's SIGTERM): a failed node, whose ranks must not checkpoint
            # and exit as if asked to stop, nor its copy change under the next attempt's restore.
            for child in children:
                procs.kill_tree(child.pid)
            os._exit(128 + signum)
        asked.append(signum)
        for child in children:  # the agent's stop: for the ranks, through torchrun
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    signal.signal(signal.SIGUSR2, lambda signum, frame: None)  # SLURM's: sent to the ranks too
    child = subprocess.Popen(command)
    children.append(child)
    if asked:
        child.send_signal(asked[0])
    code = child.wait()
    copy.finish()
    return code if code >= 0 else 128 - code


def _say(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
