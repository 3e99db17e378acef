"""Hosts that share no file system with the launcher: the user's code copied to them (``--sync``), and
the checkpoints copied back here (``Copies``). Why the launcher's machine keeps the second copy, and
why a retry never starts over silently: docs/schedulers/ssh.md, "Hosts that share no file system".
Every copy is rsync over the job's own ssh settings (``rsync -e 'ssh -o ...'``: the same host key
check, options, ProxyJump and shared connection as every other command: no new login).

``--sync DIR`` (``sync``) deletes nothing on the hosts (``--delete`` would remove what a run wrote
beside the code, such as its checkpoints); ``--mkpath`` creates the workdir. A host's checkpoints
come one pull at a time: saves that come meanwhile are taken by the next pull.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from gptlaunch.files import atomic_write
from launcher.agent.copies import absent, write_mark
from launcher.job.reports import FileBack, NodeReport, Saved
from launcher.job.spec import SpecError
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.hosts import ssh_settings
from launcher.schedulers.ssh.options import SshOptions

SYNC_TIMEOUT_S = 1800.0  # one host's copy (a large checkout, a checkpoint, through a slow link)
PULL_TIMEOUT_S = 900.0  # one pull (a GPT-2 checkpoint through a slow link); a push: SYNC_TIMEOUT_S
IO_TIMEOUT_S = 60  # rsync gives up on a link silent this long (a lost host)
_HIDDEN = ["--exclude=.*", "--exclude=*.tmp"]  # saves in progress (see launcher.agent.copies)
_STAT = re.compile(r"^(Number of regular files transferred|Total transferred file size): ([\d,]+)", re.M)


def rsync_argv(
    settings: ssh.SshSettings, host: str, source: str, dest: str, extra: Sequence[str] = ()
) -> list[str]:
    """``rsync -a --mkpath --stats EXTRA -e 'ssh ...' SOURCE/ DEST/``: SOURCE's content into DEST, one
    of them ``HOST:PATH``."""
    remote_shell = shlex.join(settings.argv(host, "")[:-3])  # the ssh client, less "-- host command"
    return ["rsync", "-a", "--mkpath", "--stats", *extra, "-e", remote_shell, f"{source}/", f"{dest}/"]


def to_hosts(
    settings: ssh.SshSettings,
    hosts: list[str],
    source: str,
    dest: str,
    extra: Sequence[str] = (),
    done: Callable[[str, str, float], None] = lambda _host, _stdout, _s: None,
) -> list[str]:
    """rsync ``source`` into ``dest`` on every host, ``settings.max_parallel`` at a time; ``done(host,
    rsync's stdout, seconds)`` as each succeeds. The failures, as ``host: error``."""

    def one(host: str) -> str | None:
        started = time.monotonic()
        argv = rsync_argv(settings, host, source, f"{host}:{dest}", extra)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=SYNC_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{host}: {e}"
        if proc.returncode != 0:
            return f"{host}: rsync exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
        done(host, proc.stdout, time.monotonic() - started)
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(settings.max_parallel, len(hosts)))) as pool:
        return [e for e in pool.map(one, hosts) if e is not None]


def transferred(stdout: str) -> tuple[int, int]:
    """(files, bytes) rsync's ``--stats`` says it transferred."""
    stats = {k: int(v.replace(",", "")) for k, v in _STAT.findall(stdout)}
    return stats.get("Number of regular files transferred", 0), stats.get("Total transferred file size", 0)


def sync(opts: SshOptions, hosts: list[str], workdir: str, say: Callable[[str], None]) -> None:
    """Copy ``opts.sync`` into ``workdir`` on every host (see the module docstring); nothing without
    ``--sync``. Raises SpecError naming every host whose copy failed, with rsync's error."""
    source, settings = opts.sync, ssh_settings(opts)
    if source is None or not hosts:
        return
    if not source.is_dir():
        raise SpecError(f"sync (--sync) {source} is not a directory here: name the directory of your code")

    def done(host: str, stdout: str, seconds: float) -> None:
        files, size = transferred(stdout)
        say(f"launcher: sync: {host}: {files} file(s), {size / 1e6:.1f} MB into {workdir} in {seconds:.1f} s")

    failed = to_hosts(settings, hosts, str(source.absolute()), workdir, done=done)
    if failed:
        raise SpecError("--sync could not copy the code to every host:\n  " + "\n  ".join(failed))


class Copies:
    """The launcher's copy of the run dir ``run_dir`` of the job in ``job_dir``, from its hosts;
    ``exclude``: dirs below it that are not copied (as the agents were told)."""

    def __init__(
        self,
        settings: ssh.SshSettings,
        job_dir: Path,
        run_dir: str,
        say: Callable[[str], None],
        exclude: tuple[str, ...] = (),
    ) -> None:
        self.settings, self.job_dir, self.run_dir, self.say = settings, job_dir, run_dir, say
        self._flags = [
            *_HIDDEN,
            *(f"--exclude=/{d.strip('/')}/" for d in exclude),
            f"--timeout={IO_TIMEOUT_S}",
        ]
        self._lock = threading.Condition()
        self._pending: dict[str, Saved] = {}  # host -> its newest save not yet pulled
        self._busy: set[str] = set()
        self._running: set[int] = set()  # pids of the pulls in flight
        self._listed: dict[str, dict[str, int]] = {}  # host -> what its last pulled save listed
        self._errors: dict[str, str] = {}  # host -> why its last pull failed
        self.newest: Saved | None = None  # the last save reported (in the order received here)
        self.pulled = False  # whether any pull succeeded (then there is a copy to push)

    def on_report(self, report: NodeReport) -> None:
        """A report from a host's channel: a ``FileBack`` written, a ``Saved`` pulled. Raises OSError
        (a file that cannot be written), which the channel logs and reads on past."""
        if isinstance(report, FileBack):
            self._write_back(report)
        elif isinstance(report, Saved) and report.directory == self.run_dir:
            self._saved(report)

    def _saved(self, report: Saved) -> None:
        with self._lock:
            self.newest = report
            self._pending[report.host] = report
            if report.host in self._busy:
                return
            self._busy.add(report.host)
        threading.Thread(target=self._pulls, args=(report.host,), daemon=True).start()

    def _write_back(self, report: FileBack) -> None:
        """Only inside the job record or the run dir (no ``..``, no symlinked dir), replacing the file
        (a symlink there is replaced, never followed)."""
        path = Path(os.path.normpath(report.path))
        roots = [Path(os.path.normpath(r)) for r in (self.job_dir, self.run_dir)]
        inside = any(path.is_relative_to(root) for root in roots)
        if inside:
            path.parent.mkdir(parents=True, exist_ok=True)
        real = Path(os.path.realpath(path.parent))
        if not inside or not any(real.is_relative_to(os.path.realpath(root)) for root in roots):
            self.say(f"launcher: ignored a file sent back from node {report.node} outside the job: {path}")
            return
        with atomic_write(path) as f:
            f.write(report.text.encode())

    def _pulls(self, host: str) -> None:
        while True:
            with self._lock:
                report = self._pending.pop(host, None)
                if report is None:
                    self._busy.discard(host)
                    self._lock.notify_all()
                    return
            self._pull(report)

    def _pull(self, report: Saved) -> bool:
        started = time.monotonic()
        argv = rsync_argv(
            self.settings, report.host, f"{report.host}:{self.run_dir}", self.run_dir, self._flags
        )
        try:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        except OSError as e:
            return self._failed(report.host, str(e))
        with self._lock:
            self._running.add(proc.pid)
        try:
            out, err = proc.communicate(timeout=PULL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err = f"no end after {PULL_TIMEOUT_S:.0f} s"
        finally:
            with self._lock:
                self._running.discard(proc.pid)
        if proc.returncode != 0:
            return self._failed(report.host, err.strip()[-300:] or f"rsync exit code {proc.returncode}")
        for gone in set(self._listed.get(report.host, {})) - set(report.files):  # the host removed it
            with contextlib.suppress(OSError):
                (Path(self.run_dir) / gone).unlink()
        self._listed[report.host], self.pulled = report.files, True
        self._errors.pop(report.host, None)
        files, size = transferred(out)
        took = time.monotonic() - started
        if files:  # a save it already has (the copy pushed to a host, reported back) is not news
            self.say(
                f"launcher: checkpoint copy: {report.host}: {files} file(s), {size / 1e6:.1f} MB in "
                f"{took:.1f} s ({size / 1e6 / max(took, 1e-3):.0f} MB/s) into {self.run_dir}"
            )
        return True

    def _failed(self, host: str, error: str) -> bool:
        self._errors[host] = error
        self.say(f"launcher: checkpoint copy from {host} failed: {error}")
        return False

    def mark(self, job_id: str) -> None:
        """The launcher's marks in the job record and the run dir: a host that sees one shares that dir
        (``launcher.agent.copies``). None in a run dir this machine cannot write (no copy there either)."""
        for marked in (self.job_dir, Path(self.run_dir)):
            with contextlib.suppress(OSError):
                write_mark(marked, job_id)

    def processes(self) -> list[psutil.Process]:
        """The pulls in flight and their ssh clients: what ending the job's other processes spares."""
        with self._lock:
            pids = list(self._running)
        found = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                found += [proc, *proc.children(recursive=True)]
        return found

    def settle(self, timeout_s: float = PULL_TIMEOUT_S) -> None:
        """Wait (at most ``timeout_s``) until no pull is in flight; a pull from a lost host ends within
        ssh's keep-alive and rsync's IO_TIMEOUT_S."""
        with self._lock:
            self._lock.wait_for(lambda: not self._busy, timeout_s)

    def missing(self) -> str | None:
        """Why the newest checkpoint is not here (None when it is, or none was reported). A host whose
        last pull failed (cut short, or the link dropped for a moment) is asked once more first."""
        newest = self.newest
        if newest is None or not absent(newest, Path(self.run_dir)):
            return None
        if self._pull(newest) and not absent(newest, Path(self.run_dir)):
            return None
        files = absent(newest, Path(self.run_dir))
        when = time.strftime("%H:%M:%S", time.localtime(newest.time))
        error = self._errors.get(newest.host, "the host was lost before the copy")
        return (
            f"the newest checkpoint ({', '.join(files[:3])} in {self.run_dir}) was saved on {newest.host} "
            f"at {when} and not copied to this machine ({error}); to resume from it, copy it here "
            f"(`rsync -a {newest.host}:{self.run_dir}/ {self.run_dir}/`) and submit again with this run dir"
        )

    def push(self, hosts: list[str]) -> None:
        """The copy into the run dir of every host (nothing when none was made), but for the files a host
        holds in a newer version (rsync's ``--update``: the copy keeps the mtimes of the host it came
        from). rsync compares whole seconds: a file the host changed within the second of the copy's
        version is still replaced (a survivor's log of a step that came within a second of the copied
        checkpoint). Raises OSError naming the hosts it could not reach."""
        if not self.pulled:
            return
        # The flags keep the launcher's mark here: a host that got it would think it shares this dir.
        # --update keeps a host's newer files: a survivor's logs hold the steps past the copy's
        # checkpoint, which a retry from the snapshot in its memory does not redo.
        failed = to_hosts(self.settings, hosts, self.run_dir, self.run_dir, [*self._flags, "--update"])
        if failed:
            raise OSError("could not copy the checkpoint to the next attempt's hosts: " + "; ".join(failed))
        self.say(f"launcher: checkpoint copy pushed to {', '.join(hosts)}")
