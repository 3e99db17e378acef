"""Hosts that share no file system: what an agent sends back (``launcher.agent.copies``) and what the
launcher does with it (``launcher.schedulers.ssh.copies``)."""

from __future__ import annotations

import os
from pathlib import Path

from launcher.agent.copies import (
    SEND_BACK_MAX_BYTES,
    CheckpointWatch,
    saved_since,
    send_back,
    shares_files,
    snapshot,
)
from launcher.job.reports import FileBack, NodeReport, Saved
from launcher.schedulers.ssh.client import SshSettings
from launcher.schedulers.ssh.copies import Copies


def _touch_later(path: Path, data: bytes, mode: str = "wb") -> None:
    """Write ``path`` and move its mtime 1 s on: a change a coarse clock cannot hide."""
    with open(path, mode) as f:
        f.write(data)
    info = path.stat()
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))


def test_a_new_file_and_a_rewrite_in_place_are_saves_an_appended_log_is_not(tmp_path: Path) -> None:
    _touch_later(tmp_path / "metrics.jsonl", b"{}\n")
    _touch_later(tmp_path / "ckpt.pt", b"x" * 100)
    (tmp_path / ".ckpt-00000010.pt.tmp").write_bytes(b"partial")  # a save in progress: never listed
    (tmp_path / "ckpt.pt.tmp").write_bytes(b"partial")
    first = snapshot(tmp_path)
    assert sorted(first) == ["ckpt.pt", "metrics.jsonl"]
    assert saved_since({}, first)

    _touch_later(tmp_path / "metrics.jsonl", b"{}\n", "ab")  # appended: grows
    assert not saved_since(first, snapshot(tmp_path))

    _touch_later(tmp_path / "ckpt.pt", b"y" * 100)  # nanoGPT's torch.save over the same file
    assert saved_since(first, snapshot(tmp_path))

    second = snapshot(tmp_path)
    _touch_later(tmp_path / "new.pt", b"z")
    os.replace(tmp_path / "new.pt", tmp_path / "ckpt.pt")  # an atomic save: a new inode
    assert saved_since(second, snapshot(tmp_path))


def test_a_save_is_reported_once_it_stayed_unchanged_for_one_poll(tmp_path: Path) -> None:
    sent: list[NodeReport] = []
    watch = CheckpointWatch(tmp_path, 1, "gl-h2", sent.append)
    watch.check()
    (tmp_path / "ckpt-00000010.pt").write_bytes(b"x" * 7)
    watch.check()  # changed since the last poll: may still be written
    assert sent == []
    watch.check()
    assert [(r.node, r.host, r.directory, r.files) for r in sent if isinstance(r, Saved)] == [
        (1, "gl-h2", str(tmp_path), {"ckpt-00000010.pt": 7})
    ]
    watch.check()  # nothing new: nothing sent
    assert len(sent) == 1


def test_the_save_made_just_before_the_command_ended_is_reported_at_finish(tmp_path: Path) -> None:
    sent: list[NodeReport] = []
    watch = CheckpointWatch(tmp_path, 0, "gl-h1", sent.append)
    watch.start()
    (tmp_path / "ckpt-00000020.pt").write_bytes(b"x")
    watch.finish()
    assert [r.files for r in sent if isinstance(r, Saved)] == [{"ckpt-00000020.pt": 1}]


def test_send_back_sends_small_files_and_skips_missing_and_large_ones(tmp_path: Path) -> None:
    errors = tmp_path / "torchelastic" / "node-1" / "abc" / "attempt_0" / "0"
    errors.mkdir(parents=True)
    (errors / "error.json").write_text('{"message": "boom"}')
    (errors / "huge.bin").write_bytes(b"x" * (SEND_BACK_MAX_BYTES + 1))
    sent: list[NodeReport] = []
    send_back([tmp_path / "torchelastic" / "node-1", tmp_path / "run" / "stopped.json"], 1, sent.append)
    assert sent == [
        FileBack(node=1, path=str(errors / "error.json"), text='{"message": "boom"}', time=sent[0].time)
    ]


def test_a_host_that_sees_the_mark_shares_the_launchers_files(tmp_path: Path) -> None:
    (tmp_path / "mark").write_text("job-1\n")
    assert shares_files(tmp_path / "mark", "job-1")
    assert not shares_files(tmp_path / "mark", "job-2") and not shares_files(tmp_path / "none", "job-1")


def _copies(tmp_path: Path, said: list[str]) -> Copies:
    settings = SshSettings(connect_timeout_s=2, control_dir=tmp_path)
    return Copies(settings, tmp_path / "job", str(tmp_path / "job" / "run"), said.append)


def test_files_sent_back_are_written_inside_the_job_only(tmp_path: Path) -> None:
    said: list[str] = []
    copies = _copies(tmp_path, said)
    inside = tmp_path / "job" / "run" / "stopped.json"
    copies.on_report(FileBack(node=0, path=str(inside), text='{"step": 3}'))
    copies.on_report(FileBack(node=0, path=str(tmp_path / "elsewhere"), text="x"))
    copies.on_report(FileBack(node=0, path=f"{tmp_path}/job/../escape", text="x"))
    assert inside.read_text() == '{"step": 3}'
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "escape").exists()
    assert len(said) == 2 and all("outside the job" in line for line in said)


def test_a_save_that_could_not_be_copied_is_named_with_the_host_and_the_fix(tmp_path: Path) -> None:
    """A real rsync over ssh to a host that does not resolve: the pull fails, and the newest save is
    out of reach."""
    said: list[str] = []
    copies = _copies(tmp_path, said)
    assert copies.missing() is None  # nothing saved: nothing missing
    run_dir = str(tmp_path / "job" / "run")
    copies.on_report(Saved(node=0, host="gone.invalid", directory=run_dir, files={"ckpt-00000020.pt": 9}))
    copies.settle(timeout_s=60)
    missing = copies.missing()
    assert missing is not None and "ckpt-00000020.pt" in missing and "saved on gone.invalid" in missing
    assert f"rsync -a gone.invalid:{run_dir}/ {run_dir}/" in missing
    assert any("checkpoint copy from gone.invalid failed" in line for line in said), said
    copies.push(["gl-h1"])  # nothing was copied: nothing to push, and no connection tried


def test_saves_of_another_dir_are_not_copied(tmp_path: Path) -> None:
    copies = _copies(tmp_path, [])
    copies.on_report(Saved(node=0, host="gl-h1", directory="/etc", files={"passwd": 1}))
    copies.settle(timeout_s=1)
    assert copies.newest is None and copies.missing() is None
