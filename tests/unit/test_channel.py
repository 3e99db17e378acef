"""The agent's channel: output and reports framed on one stream, cut apart by length, however the
stream is chunked and whatever else is written around the frames."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest

from launcher.job import channel, reports
from launcher.job.hang import HangReport


def _hang(step: int) -> reports.Hang:
    return reports.Hang(
        node=1, hang=HangReport(silent_s=31, budget_s=30, step=step, ranks=[]), time=100.0 + step
    )


def test_output_and_reports_are_cut_apart_at_any_chunking() -> None:
    # A report between two halves of one output line (a chunk of the child's output ends mid-line),
    # text outside any frame (a login script), the frame mark inside output, a report of a megabyte.
    big = _hang(2).model_copy(update={"hang": _hang(2).hang.model_copy(update={"budget_s": 1e9})})
    stream = (
        b"motd chatter\n"
        + channel.frame(channel.LOG, b"[rank0]: step 7 loss ")
        + channel.frame(channel.REPORT, reports.encode(_hang(1)))
        + channel.frame(channel.LOG, b"3.25\n\x1eL not a frame\n")
        + channel.frame(channel.REPORT, reports.encode(big) + b" " * (1 << 20))
    )
    expected = b"motd chatter\n[rank0]: step 7 loss 3.25\n\x1eL not a frame\n"
    for size in (5, 4096, len(stream)):
        log = io.BytesIO()
        got: list[reports.NodeReport] = []
        demux = channel.Demux(log, got.append)
        for i in range(0, len(stream), size):
            demux.feed(stream[i : i + size])
        demux.close()
        assert log.getvalue() == expected, size
        assert got == [_hang(1), big]


def test_a_cut_frame_and_an_unknown_report_end_up_in_the_log_not_the_reports() -> None:
    log = io.BytesIO()
    got: list[reports.NodeReport] = []
    demux = channel.Demux(log, got.append)
    demux.feed(channel.frame(channel.REPORT, b'{"kind": "from-the-future", "node": 0}'))
    cut = channel.frame(channel.LOG, b"the last words")[:-3]
    demux.feed(cut)
    demux.close()
    assert b"a report this launcher cannot read" in log.getvalue()
    assert log.getvalue().endswith(cut)
    assert got == []


def test_pump_appends_reports_to_the_record_but_no_file_back_and_reads_on_past_a_failing_also(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    back = reports.FileBack(node=1, path=str(tmp_path / "error.json"), text="{}", time=101.5)
    sent: list[reports.NodeReport] = [_hang(1), back, _hang(2)]
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as w:  # a few hundred bytes: the pipe holds them all, then EOF
        w.write(b"".join(channel.frame(channel.REPORT, reports.encode(r)) for r in sent))
    seen: list[reports.NodeReport] = []

    def also(report: reports.NodeReport) -> None:
        seen.append(report)
        if len(seen) == 1:
            raise OSError("disk full")

    with os.fdopen(read_fd, "rb") as r:
        channel.pump(r, tmp_path / "node-1.log", tmp_path, also)
    assert reports.read_all(tmp_path / reports.REPORTS_DIR) == [_hang(1), _hang(2)]  # no FileBack
    assert seen == sent  # each handed on, the FileBack too, after also failed on the first
    assert "launcher: a report of node 1 failed: OSError('disk full')" in capsys.readouterr().err


def test_the_sender_frames_writes_from_many_threads_whole_through_a_pipe(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    sender = channel.Sender(write_fd)
    line = b"x" * 100_000 + b"\n"  # larger than the pipe's buffer: written in parts, under the lock

    def send() -> None:
        for _ in range(5):
            sender.output(line)
            sender.report(_hang(3))

    threads = [threading.Thread(target=send) for _ in range(4)]
    pump = threading.Thread(
        target=channel.pump, args=(os.fdopen(read_fd, "rb"), tmp_path / "node-1.log", tmp_path)
    )
    pump.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.close(write_fd)
    pump.join()
    assert (tmp_path / "node-1.log").read_bytes() == line * 20
    assert reports.read(tmp_path, reports.Hang) == [_hang(3)] * 20


def test_a_sender_whose_reader_is_gone_says_so_and_stops(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    sender = channel.Sender(write_fd)
    sender.output(b"lost")  # EPIPE (Python ignores SIGPIPE), not an exception
    assert not sender.connected
    os.close(write_fd)
