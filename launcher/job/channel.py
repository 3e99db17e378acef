"""An agent's channel to the launcher over one byte stream (an SSH host agent's stdout, which the ssh
client hands the launcher): the node's output for its log and its reports (``launcher.job.reports``),
framed so that neither is ever taken for the other.

A frame is ``\\x1e``, a kind byte (``L``: output for the node log; ``R``: one report), eight hex digits
of payload length, then the payload. The agent writes each frame with one ``write`` under one lock, so
frames never interleave; the launcher's ``Demux`` cuts them by length, never by looking at the text. Bytes
outside any frame (a login script's chatter) go to the log, as output.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from launcher.job import reports
from launcher.job.reports import NodeReport

MARK = b"\x1e"
LOG, REPORT = b"L", b"R"
_HEADER = 10  # mark, kind, 8 hex digits
_MAX_FRAME = 1 << 26  # 64 MiB: a hang report of hundreds of ranks' stacks is a few MB


def frame(kind: bytes, payload: bytes) -> bytes:
    return MARK + kind + f"{len(payload):08x}".encode() + payload


class Sender:
    """The agent's end: frames to ``fd`` (its stdout) until a write fails (the connection dropped),
    after which ``connected`` is False and nothing more is sent."""

    def __init__(self, fd: int) -> None:
        self.fd, self.connected = fd, True
        self._lock = threading.Lock()

    def output(self, data: bytes) -> None:
        self._send(frame(LOG, data))

    def report(self, report: NodeReport) -> None:
        self._send(frame(REPORT, reports.encode(report)))

    def _send(self, data: bytes) -> None:
        with self._lock:
            if not self.connected:
                return
            try:
                while data:  # a pipe may take a large frame in parts; the lock keeps them together
                    data = data[os.write(self.fd, data) :]
            except OSError:
                self.connected = False


class Demux:
    """The launcher's end: ``feed`` it the stream's bytes; output is appended to ``log``, each report
    handed to ``on_report`` (``pump``: appended to the job record)."""

    def __init__(self, log: BinaryIO, on_report: Callable[[NodeReport], None]) -> None:
        self.log, self.on_report = log, on_report
        self._buffer = bytearray()  # appended to in place: a large frame in many chunks stays linear

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while self._buffer and self._take():
            pass
        self.log.flush()

    def close(self) -> None:
        """At the stream's end: what is left of a cut frame is output."""
        self.log.write(self._buffer)
        self.log.flush()
        self._buffer.clear()

    def _take(self) -> bool:
        """Consume one frame or one run of bytes outside frames; False while more bytes are needed."""
        buf = self._buffer
        if buf[:1] != MARK:
            end = buf.find(MARK)
            end = len(buf) if end < 0 else end
            self.log.write(buf[:end])
            del buf[:end]
            return True
        if len(buf) < _HEADER:
            return False
        kind, size = bytes(buf[1:2]), _length(bytes(buf[2:_HEADER]))
        if kind not in (LOG, REPORT) or size is None:  # not a frame: the mark was output
            self.log.write(MARK)
            del buf[:1]
            return True
        if len(buf) < _HEADER + size:
            return False
        payload = bytes(buf[_HEADER : _HEADER + size])
        del buf[: _HEADER + size]
        if kind == LOG:
            self.log.write(payload)
        else:
            self._report(payload)
        return True

    def _report(self, payload: bytes) -> None:
        try:
            report = reports.decode(payload)
        except ValueError as e:  # another version's report: say so where a person looks
            self.log.write(f"launcher: a report this launcher cannot read: {e}\n".encode())
            return
        self.on_report(report)


def _length(digits: bytes) -> int | None:
    if any(c not in b"0123456789abcdef" for c in digits):
        return None
    size = int(digits, 16)
    return size if size <= _MAX_FRAME else None


def pump(
    stream: BinaryIO, log: Path, job_dir: Path, also: Callable[[NodeReport], None] | None = None
) -> None:
    """Demultiplex ``stream`` (until its end) into ``log`` and the job record's reports, each then
    handed to ``also`` (a ``FileBack`` is a file, not a report: ``also`` writes it)."""

    def on_report(report: NodeReport) -> None:
        if not isinstance(report, reports.FileBack):
            reports.append(job_dir, report)
        if also is not None:
            try:
                also(report)
            except Exception as e:  # the channel must be read on: its node's later reports matter more
                print(f"launcher: a report of node {report.node} failed: {e!r}", file=sys.stderr, flush=True)

    with open(log, "ab") as out:
        demux = Demux(out, on_report)
        for chunk in iter(lambda: os.read(stream.fileno(), 1 << 16), b""):
            demux.feed(chunk)
        demux.close()
