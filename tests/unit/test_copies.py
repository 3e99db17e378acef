"""Hosts that share no file system: what an agent sends back (``launcher.agent.copies``) and what the
launcher does with it (``launcher.schedulers.ssh.copies``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launcher.agent.copies import (
    MARK,
    SEND_BACK_MAX_BYTES,
    CheckpointWatch,
    absent,
    saved_since,
    send_back,
    shares_files,
    snapshot,
)
from launcher.agent.transport import back_flags, channel_reports
from launcher.job.reports import FileBack, NodeReport, Saved
from launcher.job.spec import JobSpec, Program
from launcher.job.torchrun import copy_excludes
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
    (tmp_path / "compile-cache").mkdir()
    (tmp_path / "compile-cache" / "key.bin").write_bytes(b"artifacts")  # copied along, never a save
    assert "compile-cache/key.bin" in snapshot(tmp_path) and not saved_since(first, snapshot(tmp_path))

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
    assert [list(r.changed) for r in sent if isinstance(r, Saved)] == [["ckpt-00000010.pt"]]
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
    (tmp_path / "job" / "run").mkdir(parents=True)
    (tmp_path / "job" / "run" / "linked").symlink_to(tmp_path)  # e.g. pulled from a host
    copies.on_report(FileBack(node=0, path=str(inside), text='{"step": 3}'))
    copies.on_report(FileBack(node=0, path=f"{tmp_path}/job/run/../run/stopped.json", text='{"step": 4}'))
    copies.on_report(FileBack(node=0, path=str(tmp_path / "elsewhere"), text="x"))
    copies.on_report(FileBack(node=0, path=f"{tmp_path}/job/../escape", text="x"))
    copies.on_report(FileBack(node=0, path=f"{tmp_path}/job/run/linked/through", text="x"))
    assert inside.read_text() == '{"step": 4}'
    assert not any((tmp_path / name).exists() for name in ("elsewhere", "escape", "through"))
    assert len(said) == 3 and all("outside the job" in line for line in said), said


def test_the_copy_holds_a_save_when_its_files_are_there_in_that_version_or_later(tmp_path: Path) -> None:
    run_dir = tmp_path / "job" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "ckpt.pt").write_bytes(b"x")
    here = (run_dir / "ckpt.pt").stat().st_mtime_ns
    older, newer = {"ckpt.pt": here - 5_000_000_000}, {"ckpt.pt": here + 5_000_000_000}
    saved = Saved(node=0, host="h", directory=str(run_dir), files={"ckpt.pt": 1}, changed=older)
    assert absent(saved, run_dir) == []
    assert absent(saved.model_copy(update={"changed": newer}), run_dir) == ["ckpt.pt"]
    assert absent(saved.model_copy(update={"changed": {"ckpt-2.pt": 0}}), run_dir) == ["ckpt-2.pt"]


def test_the_files_missing_from_a_copy_are_named_largest_first(tmp_path: Path) -> None:
    """A message names the first few: the checkpoint, not the logs saved in the same poll."""
    files = {"metrics.jsonl": 900, "ckpt-5.pt": 7_000_000, "peak_flops.json": 40, "events.out": 2_000}
    saved = Saved(node=0, host="h", directory="/r", files=files, changed=dict.fromkeys(files, 10**18))
    assert absent(saved, tmp_path) == ["ckpt-5.pt", "events.out", "metrics.jsonl", "peak_flops.json"]


def test_the_trainers_prepared_data_is_not_watched(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.bin").write_bytes(b"x")
    (tmp_path / "ckpt-00000010.pt").write_bytes(b"x")
    assert sorted(snapshot(tmp_path, exclude=("data",))) == ["ckpt-00000010.pt"]


def test_a_save_that_could_not_be_copied_is_named_with_the_host_and_the_fix(tmp_path: Path) -> None:
    """A real rsync over ssh to a host that does not resolve: the pull fails, and the newest save is
    out of reach."""
    said: list[str] = []
    copies = _copies(tmp_path, said)
    assert copies.missing() is None  # nothing saved: nothing missing
    run_dir = str(tmp_path / "job" / "run")
    saved = {"ckpt-00000020.pt": 9}
    copies.on_report(
        Saved(node=0, host="gone.invalid", directory=run_dir, files=saved, changed={"ckpt-00000020.pt": 1})
    )
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


def test_only_the_built_in_trainers_data_dir_below_the_run_dir_is_left_out_of_the_copy() -> None:
    trainer = JobSpec(trainer_args=["--max-steps", "3"])
    assert copy_excludes(trainer, "/w", "/w/jobs/j/run") == ("data",)
    elsewhere = JobSpec(trainer_args=["--data-dir", "../data"])
    assert copy_excludes(elsewhere, "/w", "/w/jobs/j/run") == ()
    inside = JobSpec(trainer_args=["--data-dir", "jobs/j/run/tokens"])
    assert copy_excludes(inside, "/w", "/w/jobs/j/run") == ("tokens",)
    program = JobSpec(program=Program(kind="script", target="train.py"))
    assert copy_excludes(program, "/w", "/w/jobs/j/run") == ()


def test_the_agent_reports_the_last_save_and_sends_back_files_once_its_command_ended(tmp_path: Path) -> None:
    """``python -m launcher.agent run`` with the flags ``back_flags`` renders, on a host that does not
    see the launcher's marks: its channel carries the run dir's save (not the excluded data) and the
    error file, as reports."""
    run_dir, job_dir = tmp_path / "run", tmp_path / "job"
    (run_dir / "data").mkdir(parents=True)
    (run_dir / "data" / "train.bin").write_bytes(b"x")
    (run_dir / "ckpt-00000010.pt").write_bytes(b"x" * 3)
    errors = job_dir / "torchelastic" / "node-1" / "a" / "attempt_0" / "0"
    errors.mkdir(parents=True)
    (errors / "error.json").write_text("{}")
    flags = back_flags(job_dir, 1, run_dir, ["data"])
    argv = [sys.executable, "-m", "launcher.agent", "run", "--job", "j", "--node", "1",
            f"--state-dir={tmp_path / 'state'}", *flags, "--", "true"]  # fmt: skip
    done = subprocess.run(argv, input=b"{}\n", capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    _, found = channel_reports(done.stdout)
    assert [r.files for r in found if isinstance(r, Saved)] == [{"ckpt-00000010.pt": 3}]
    assert [r.path for r in found if isinstance(r, FileBack)] == [str(errors / "error.json")]
    (job_dir / MARK).write_text("j")  # the launcher's marks: this host shares both dirs
    (run_dir / MARK).write_text("j")
    _, shared = channel_reports(subprocess.run(argv, input=b"{}\n", capture_output=True, timeout=60).stdout)
    assert not [r for r in shared if isinstance(r, Saved | FileBack)]
