"""Following per-node log files: the terminal view of a job and ``launcher logs --follow``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TextIO


class LogFollower(threading.Thread):
    """Copies new lines of each ``(label, file)`` to ``out`` as ``label | line`` until ``stop()``,
    then drains what is left. Files that do not exist yet are picked up when they appear."""

    def __init__(self, files: list[tuple[str, Path]], out: TextIO, from_start: bool = True) -> None:
        super().__init__(daemon=True)
        self._files = files
        self._out: TextIO | None = out
        self._from_start = from_start
        self._stopping = threading.Event()
        self._handles: dict[Path, TextIO] = {}
        self._partial: dict[Path, str] = {}

    def stop(self) -> None:
        self._stopping.set()
        self.join()

    def _pump(self) -> bool:
        moved = False
        for label, path in self._files:
            handle = self._handles.get(path)
            if handle is None:
                if not path.exists():
                    continue
                handle = self._handles[path] = open(path, errors="replace")  # noqa: SIM115
                if not self._from_start:
                    handle.seek(0, 2)
            chunk = handle.read()
            if not chunk:
                continue
            moved = True
            text = self._partial.pop(path, "") + chunk
            *lines, rest = text.split("\n")
            if rest:
                self._partial[path] = rest
            self._write("".join(f"{label} | {line}\n" for line in lines))
        return moved

    def _write(self, text: str) -> None:
        if self._out is None:
            return
        try:
            self._out.write(text)
            self._out.flush()
        except OSError:  # the terminal went away (SIGHUP): the node logs still have everything
            self._out = None

    def run(self) -> None:
        while not self._stopping.is_set():
            if not self._pump():
                self._stopping.wait(0.2)
        self._pump()
        for path, rest in self._partial.items():
            label = next(lbl for lbl, p in self._files if p == path)
            self._write(f"{label} | {rest}\n")
        for handle in self._handles.values():
            handle.close()
