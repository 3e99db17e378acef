"""What a node on a host that shares no file system with the launcher sends back over its agent's
channel (``launcher.job.channel``), so that the job record on the launcher's machine stays whole:

- ``CheckpointWatch``: each new checkpoint in the node's checkpoint dir, as a ``Saved`` report, upon
  which the launcher copies that dir to its own machine (``launcher.schedulers.ssh.copies``);
- ``send_back``: the small files a node writes for the launcher (torchelastic's error files, the stop
  marker), as ``FileBack`` reports, once the node's command ended.

Whether the host shares the launcher's file system is known from a mark the launcher writes in the
job record (``shares_files``): a host that sees it sends nothing back, as the launcher reads the files
itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from launcher.job.reports import FileBack, NodeReport, Saved

POLL_S = 1.0  # how often the checkpoint dir is looked at (a scandir: microseconds)
SEND_BACK_MAX_BYTES = 1 << 20  # an error file is a few KB; anything larger is not ours to send
MARK = ".launcher-mark"  # in the job record: holds the job id

# Below the run dir: copied with the next save, never a save of its own (``trainer.compile_cache``'s
# artifacts: a new one must not become "the newest checkpoint" that a retry refuses to go on without).
ALONG = ("compile-cache/",)
# name -> (inode, bytes, mtime in ns)
Snapshot = dict[str, tuple[int, int, int]]


def shares_files(mark: Path, job_id: str) -> bool:
    """Whether this host sees the launcher's mark of ``job_id`` (``MARK`` in the job record)."""
    try:
        return mark.read_text().strip() == job_id
    except OSError:
        return False


def snapshot(directory: Path, exclude: tuple[str, ...] = ()) -> Snapshot:
    """Every file below ``directory`` (relative POSIX names), but hidden ones, ``*.tmp`` (a save in
    progress: the trainer's ``.ckpt-*.tmp``, a script's ``ckpt.pt.tmp``) and those below ``exclude``
    (relative dirs: the trainer's prepared data, which each node makes for itself)."""
    # Everything else is copied, the trainer's compile artifacts (``compile-cache/``, see
    # trainer.compile_cache) too: a spare host gets them with the checkpoint, and its compile skips
    # Inductor's lowering and autotuning. Their temporary file while written is hidden, like a checkpoint's.
    found: Snapshot = {}
    try:
        paths = [p for p in directory.rglob("*") if p.is_file()]
    except OSError:  # not made yet, or removed while listed: nothing to copy now
        return found
    for path in paths:
        name = path.relative_to(directory).as_posix()
        hidden = any(part.startswith(".") for part in name.split("/")) or name.endswith(".tmp")
        if hidden or any(name.startswith(f"{skip.rstrip('/')}/") for skip in exclude):
            continue
        try:
            info = path.stat()
        except OSError:
            continue
        found[name] = (info.st_ino, info.st_size, info.st_mtime_ns)
    return found


def saved_since(old: Snapshot, new: Snapshot) -> dict[str, int]:
    """The files of ``new`` that make a save ``old`` did not hold (name -> mtime in ns): a file that
    appeared or was renamed into place (a new inode), or one rewritten in place (a newer mtime at a
    size that did not grow). A log that is only appended to (``metrics.jsonl``, TensorBoard's events)
    always grows: it is copied with the next checkpoint, not on its own. So are the trainer's compile
    artifacts (``ALONG``): a cache, not a save, which a retry may not miss."""
    changed = {}
    for name, (inode, size, mtime) in new.items():
        if name.startswith(ALONG):
            continue
        before = old.get(name)
        if before is None or before[0] != inode or (mtime != before[2] and size <= before[1]):
            changed[name] = mtime
    return changed


class CheckpointWatch:
    """Polls ``directory`` every POLL_S seconds; a save that then stayed unchanged for one poll is
    reported as ``Saved`` (every file's size, and the mtimes of those that made it a save), through
    ``report``. ``exclude``: dirs below ``directory`` that are not copied (see ``snapshot``)."""

    def __init__(
        self,
        directory: Path,
        node: int,
        host: str,
        report: Callable[[NodeReport], None],
        exclude: tuple[str, ...] = (),
    ) -> None:
        self.directory, self.node, self.host, self.report = directory, node, host, report
        self.exclude = exclude
        self._sent: Snapshot = {}
        self._last: Snapshot | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, known: Snapshot | None = None) -> None:
        """Poll from now on; ``known``: the files already copied (not reported as a save)."""
        self._sent = known or {}
        self._thread.start()

    def finish(self) -> None:
        """After the command ended: stop polling, and report what was saved last (the files have
        settled: nothing writes them any more)."""
        self._stop.set()
        self._thread.join()
        self._last = snapshot(self.directory, self.exclude)
        self.check()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.check()
            except Exception as e:
                logging.getLogger(__name__).warning("checkpoint watch of %s: %s", self.directory, e)

    def check(self) -> None:
        now = snapshot(self.directory, self.exclude)
        changed = saved_since(self._sent, now) if now == self._last else {}
        if changed:
            files = {name: size for name, (_, size, _) in sorted(now.items())}
            self.report(
                Saved(
                    node=self.node,
                    host=self.host,
                    directory=str(self.directory),
                    files=files,
                    changed=changed,
                )
            )
            self._sent = now
        self._last = now


def absent(report: Saved, directory: Path) -> list[str]:
    """The files that made ``report`` a save and are not in ``directory`` in that version or a later
    one (copies keep the saved files' mtimes: a file at least as new, to the second, holds it),
    largest first: a message that names a few names the checkpoint, not the logs saved beside it."""
    missing = []
    for name, mtime_ns in report.changed.items():
        try:
            here = (directory / name).stat().st_mtime_ns
        except OSError:
            here = -1
        if here // 1_000_000_000 < mtime_ns // 1_000_000_000:
            missing.append(name)
    return sorted(missing, key=lambda name: -report.files.get(name, 0))


def write_mark(directory: Path, job_id: str) -> None:
    """The launcher's mark of ``job_id`` in ``directory`` (made if needed): a host or node that sees
    it shares that dir (``shares_files``). Raises OSError when it cannot be written."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARK).write_text(job_id)


def send_back(paths: Iterable[Path], node: int, report: Callable[[NodeReport], None]) -> None:
    """Each file of ``paths`` (files, or directories searched recursively) up to SEND_BACK_MAX_BYTES,
    as a ``FileBack`` report; missing ones are skipped (no error file: no error)."""
    for path in paths:
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        for file in files:
            try:
                if file.stat().st_size <= SEND_BACK_MAX_BYTES:
                    text = file.read_text(errors="replace")
                    report(FileBack(node=node, path=str(file.absolute()), text=text))
            except OSError:
                continue
