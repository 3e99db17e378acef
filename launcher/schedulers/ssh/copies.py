"""Hosts that share no file system with the launcher: the job record stays whole here, and a
checkpoint survives the loss of any one host.

Design: **the launcher's machine keeps the second copy.** A host's agent reports each new checkpoint
in the run dir (``launcher.agent.copies``: a ``Saved`` report on its channel); the launcher then pulls
that dir to the same path here, with rsync over the job's own ssh settings (the shared connection:
no new login), one pull a host at a time; saves that come meanwhile are taken by the next pull. A
pull copies only what changed (rsync's quick check), off the ranks' critical path: training stalls
only for the disk and link it shares with the read. Before a next attempt the copy is pushed to every
host of it (rank 0 may land on any node; a spare has nothing), so node 0 has the checkpoint before
its ranks start.

Why not a peer host: it needs host-to-host logins that a user's boxes rarely have, and a peer is
one more host that can be lost with the first. The launcher's machine is the one that must live for
the job anyway (it holds the job record), and it is the "location the user names" when they name
none: ``--run-dir`` on a file system of their choosing moves both copies.

**Never a silent restart** (``check``): a next attempt whose newest checkpoint the record knows of
(the last ``Saved``) was never copied here fails, naming the host and files, unless the user allowed
starting over (``--allow-start-over``).
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from launcher.job.reports import FileBack, NodeReport, Saved
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.sync import rsync_argv, transferred

PULL_TIMEOUT_S = 900.0  # one pull (a GPT-2 checkpoint through a slow link)
SETTLE_S = 60.0  # at most, the wait for pulls in flight before a next attempt is judged
_EXCLUDE = ["--exclude=.*", "--exclude=*.tmp"]  # saves in progress (see launcher.agent.copies)


class Copies:
    """The launcher's copy of the run dir ``run_dir`` of the job in ``job_dir``, from its hosts."""

    def __init__(self, settings: ssh.SshSettings, job_dir: Path, run_dir: str, say: Callable[[str], None]):
        self.settings, self.job_dir, self.run_dir, self.say = settings, job_dir, run_dir, say
        self._lock = threading.Condition()
        self._pending: dict[str, Saved] = {}  # host -> its newest save not yet pulled
        self._busy: set[str] = set()
        self._listed: dict[str, dict[str, int]] = {}  # host -> what its last pulled save listed
        self._errors: dict[str, str] = {}  # host -> why its last pull failed
        self.newest: Saved | None = None  # the newest save any host reported
        self.copied: Saved | None = None  # the newest save whose pull finished

    def on_report(self, report: NodeReport) -> None:
        """A report from a host's channel: a ``FileBack`` written, a ``Saved`` pulled."""
        if isinstance(report, FileBack):
            self._write_back(report)
        elif isinstance(report, Saved) and report.directory == self.run_dir:
            with self._lock:
                if self.newest is None or report.time >= self.newest.time:
                    self.newest = report
                self._pending[report.host] = report
                if report.host in self._busy:
                    return
                self._busy.add(report.host)
            threading.Thread(target=self._pulls, args=(report.host,), daemon=True).start()

    def _write_back(self, report: FileBack) -> None:
        path = Path(report.path)
        if (
            not any(path.is_relative_to(root) for root in (self.job_dir, Path(self.run_dir)))
            or ".." in path.parts
        ):
            self.say(f"launcher: ignored a file sent back from node {report.node} outside the job: {path}")
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report.text)

    def _pulls(self, host: str) -> None:
        while True:
            with self._lock:
                report = self._pending.pop(host, None)
                if report is None:
                    self._busy.discard(host)
                    self._lock.notify_all()
                    return
            if self._pull(report):
                with self._lock:
                    if self.copied is None or report.time >= self.copied.time:
                        self.copied = report

    def _pull(self, report: Saved) -> bool:
        started = time.monotonic()
        argv = rsync_argv(self.settings, report.host, f"{report.host}:{self.run_dir}", self.run_dir)
        try:
            done = subprocess.run(argv[:2] + _EXCLUDE + argv[2:], capture_output=True, text=True,
                                  timeout=PULL_TIMEOUT_S)  # fmt: skip
            error = done.stderr.strip()[-300:] if done.returncode else ""
        except (OSError, subprocess.TimeoutExpired) as e:
            error = str(e)
        if error:
            self._errors[report.host] = error
            self.say(f"launcher: checkpoint copy from {report.host} failed: {error}")
            return False
        for gone in set(self._listed.get(report.host, {})) - set(report.files):  # the host removed it
            with contextlib.suppress(OSError):
                (Path(self.run_dir) / gone).unlink()
        self._listed[report.host] = report.files
        files, size = transferred(done.stdout)
        took = time.monotonic() - started
        if files:  # a save it already has (the copy pushed to a host, reported back) is not news
            self.say(
                f"launcher: checkpoint copy: {report.host}: {files} file(s), {size / 1e6:.1f} MB in "
                f"{took:.1f} s ({size / 1e6 / max(took, 1e-3):.0f} MB/s) into {self.run_dir}"
            )
        return True

    def settle(self, timeout_s: float = SETTLE_S) -> None:
        """Wait (at most ``timeout_s``) until no pull is in flight."""
        with self._lock:
            self._lock.wait_for(lambda: not self._busy, timeout_s)

    def missing(self) -> str | None:
        """Why the newest checkpoint is not here (None when it is, or none was reported)."""
        with self._lock:
            newest, copied = self.newest, self.copied
        if newest is None or (copied is not None and copied.time >= newest.time):
            return None
        have = copied.files if copied is not None else {}
        new = [name for name, size in newest.files.items() if have.get(name) != size]
        when = time.strftime("%H:%M:%S", time.localtime(newest.time))
        error = self._errors.get(newest.host, "the host was lost before the copy")
        return (
            f"the newest checkpoint ({', '.join(new[:3]) or 'its files'} in {self.run_dir}) was saved on "
            f"{newest.host} at {when} and not copied to this machine ({error}); to resume from it, copy "
            f"it here (`rsync -a {newest.host}:{self.run_dir}/ {self.run_dir}/`) and submit again with this "
            "run dir"
        )

    def push(self, hosts: list[str]) -> None:
        """The copy into the run dir of every host (nothing when none was made). Raises OSError naming
        the hosts it could not reach."""
        if self.copied is None:
            return

        def one(host: str) -> str | None:
            argv = rsync_argv(self.settings, host, self.run_dir, f"{host}:{self.run_dir}")
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=PULL_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"{host}: {e}"
            return None if done.returncode == 0 else f"{host}: {done.stderr.strip()[-300:]}"

        with ThreadPoolExecutor(max_workers=max(1, min(self.settings.max_parallel, len(hosts)))) as pool:
            failed = [e for e in pool.map(one, hosts) if e is not None]
        if failed:
            raise OSError("could not copy the checkpoint to the next attempt's hosts: " + "; ".join(failed))
        self.say(f"launcher: checkpoint copy pushed to {', '.join(hosts)}")
