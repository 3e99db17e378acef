"""``reports.Tail``: what the nodes report from an attempt's start on, each report read once, a line
still being written left for the next read."""

from __future__ import annotations

from pathlib import Path

from launcher.job import reports
from launcher.job.reports import REPORTS_DIR, RankFailed


def test_a_tail_reads_each_report_once_from_its_start_on_and_waits_for_a_whole_line(tmp_path: Path) -> None:
    reports.append(tmp_path, RankFailed(node=0, local_rank=0, exit_code=1))  # an earlier attempt's
    tail = reports.Tail(tmp_path)
    assert tail.new() == []
    later = RankFailed(node=1, local_rank=1, exit_code=-9)
    reports.append(tmp_path, later)
    assert tail.new() == [later]
    assert tail.new() == []
    path = tmp_path / REPORTS_DIR / "node-1.jsonl"
    line = reports.encode(RankFailed(node=1, local_rank=0, exit_code=-9))
    with path.open("ab") as f:
        f.write(line[:10])  # a writer in mid-line
    assert tail.new() == []
    with path.open("ab") as f:
        f.write(line[10:])
    assert [r.local_rank for r in tail.new() if isinstance(r, RankFailed)] == [0]


def test_a_whole_read_takes_a_last_report_that_lost_only_its_newline(tmp_path: Path) -> None:
    """A write cut just before its newline (a full disk) still left a report ``read_all`` acts on,
    while a tail waits for the line's end."""
    tail = reports.Tail(tmp_path)
    (tmp_path / REPORTS_DIR).mkdir()
    cut = RankFailed(node=0, local_rank=1, exit_code=-9)
    (tmp_path / REPORTS_DIR / "node-0.jsonl").write_bytes(reports.encode(cut).rstrip(b"\n"))
    assert reports.read_all(tmp_path / REPORTS_DIR) == [cut]
    assert tail.new() == []
