"""SLURM nodes with a node-local run dir (``launcher.schedulers.slurm.run_copy``): each save goes into
the job record's copy, every node restores that copy before its ranks start, and a node refuses to
start when the newest save is not in it. The real thing, on a SLURM cluster whose nodes each have
their own disk, is in ``tests/integration/test_slurm.py``."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from gptlaunch.contract import EXIT_REFUSED
from launcher.agent.copies import MARK, write_mark
from launcher.job import reports
from launcher.job.failures import RUN_COPY
from launcher.job.reports import Refused, Saved
from launcher.schedulers.slurm import run_copy
from launcher.schedulers.slurm.run_copy import NOT_IN_COPY, RunCopy, copy_file, node_local


def _saved_once(job: Path, run: Path, write: dict[str, bytes], remove: tuple[str, ...] = ()) -> RunCopy:
    """A node's copy that watched ``run`` while ``write`` was written and ``remove`` removed."""
    copy = RunCopy(job, run, node=1, host="n2", say=lambda line: None)
    copy.start()
    for name, data in write.items():
        (run / name).write_bytes(data)
    for name in remove:
        (run / name).unlink()
    copy.finish()
    return copy


def test_a_save_is_recorded_then_copied_with_its_mtime_and_a_removed_one_leaves_the_copy(
    tmp_path: Path,
) -> None:
    job, run = tmp_path / "job", tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    _saved_once(job, run, {"ckpt-1.pt": b"a" * 10, "metrics.jsonl": b"{}\n{}\n"})
    assert (job / RUN_COPY / "metrics.jsonl").read_text() == "{}\n{}\n"  # an appended log comes along
    copied = job / RUN_COPY / "ckpt-1.pt"
    assert copied.read_bytes() == b"a" * 10
    assert copied.stat().st_mtime_ns == (run / "ckpt-1.pt").stat().st_mtime_ns  # what ``absent`` compares
    (saved,) = reports.read(job, Saved)
    assert (saved.node, saved.host, list(saved.changed)) == (1, "n2", ["ckpt-1.pt"])
    _saved_once(job, run, {"ckpt-2.pt": b"b" * 10}, remove=("ckpt-1.pt",))  # the trainer's rotation
    assert sorted(p.name for p in (job / RUN_COPY).iterdir()) == ["ckpt-2.pt", "metrics.jsonl"]


def test_the_files_a_node_already_had_are_not_copied_again(tmp_path: Path) -> None:
    job, run = tmp_path / "job", tmp_path / "run"
    run.mkdir()
    (run / "ckpt-1.pt").write_bytes(b"old")  # restored, or there before
    _saved_once(job, run, {})
    assert reports.read(job, Saved) == [] and not (job / RUN_COPY).exists()


def test_a_copy_that_fails_is_said_and_the_save_stays_recorded(tmp_path: Path) -> None:
    job, run = tmp_path / "job", tmp_path / "run"
    run.mkdir()
    job.mkdir()
    (job / RUN_COPY).write_text("not a dir")  # the copy cannot be made
    said: list[str] = []
    copy = RunCopy(job, run, node=0, host="n1", say=said.append)
    copy.start()
    (run / "ckpt-1.pt").write_bytes(b"x")
    copy.finish()
    assert len(reports.read(job, Saved)) == 1
    assert any("copy of the run dir's save" in line and "failed" in line for line in said), said


def test_every_node_restores_what_it_lacks_and_sets_aside_saves_the_copy_lacks(tmp_path: Path) -> None:
    job, run = tmp_path / "job", tmp_path / "run"
    (job / RUN_COPY / "sub").mkdir(parents=True)
    (job / RUN_COPY / "ckpt-2.pt").write_bytes(b"saved")
    (job / RUN_COPY / "sub" / "state.json").write_text("{}")
    said: list[str] = []
    RunCopy(job, run, node=2, host="n3", say=said.append).restore()
    assert (run / "ckpt-2.pt").read_bytes() == b"saved" and (run / "sub" / "state.json").is_file()
    assert (run / "ckpt-2.pt").stat().st_mtime_ns == (job / RUN_COPY / "ckpt-2.pt").stat().st_mtime_ns
    assert said == [f"task: restored 2 file(s) of the run dir from its copy {job / RUN_COPY}"]
    said.clear()
    RunCopy(job, run, node=2, host="n3", say=said.append).restore()  # the same: nothing to do
    assert said == []
    (run / "ckpt-3.pt").write_bytes(b"saved here, never copied")  # then this node was lost
    (run / "data").mkdir()
    (run / "data" / "train.bin").write_bytes(b"prepared")  # each node's own: never copied
    reports.append(job, Saved(node=0, host="n1", directory=str(run), files={}, changed={}))
    RunCopy(job, run, node=2, host="n3", say=said.append, exclude=("data",)).restore()
    assert not (run / "ckpt-3.pt").exists() and (run / NOT_IN_COPY / "ckpt-3.pt").is_file()
    assert (run / "data" / "train.bin").is_file() and (run / "ckpt-2.pt").is_file()
    moved = f"; 1 not in it moved to {run / NOT_IN_COPY}"
    assert said == [f"task: restored 0 file(s) of the run dir from its copy {job / RUN_COPY}{moved}"]


def test_a_node_refuses_to_start_without_the_newest_save_unless_starting_over_is_allowed(
    tmp_path: Path, capsys
) -> None:
    """The wrapper in front of a node's command (``run_copy.main``): with a save the copy lacks, the
    node refuses (exit 3, a ``Refused`` report naming it) unless starting over is allowed."""
    job, run = tmp_path / "job", tmp_path / "run"
    run.mkdir()
    newest = {"ckpt-20.pt": 10**18}  # saved at an mtime no copy here has
    saved = Saved(node=0, host="n1", directory=str(run), files={"ckpt-20.pt": 5}, changed=newest)
    reports.append(job, saved)
    flags = ["--job-dir", str(job), "--run-dir", str(run), "--node", "1", "--job-id", "j"]
    flags.append("--node-local-run-dir")
    ran = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"]
    assert run_copy.main([*flags, *command]) == EXIT_REFUSED and not ran.exists()
    (refused,) = reports.read(job, Refused)
    assert refused.check == "checkpoint" and refused.node == 1
    for words in ("ckpt-20.pt", "n1 (node 0)", str(run), str(job / RUN_COPY), "--allow-start-over"):
        assert words in refused.message, (words, refused.message)
    assert run_copy.main([*flags, "--allow-start-over", *command]) == 0 and ran.exists()
    said = capsys.readouterr().out
    assert "task: not started: the newest checkpoint" in said and "going on from an older checkpoint" in said


def test_a_run_dir_is_node_local_when_declared_or_when_the_node_misses_the_launchers_mark(
    tmp_path: Path,
) -> None:
    assert node_local(tmp_path, "job-1", declared=True) and not node_local(tmp_path, "job-1", declared=False)
    assert node_local(tmp_path, "job-1", declared=None)  # no mark here: written on another machine's disk
    assert not node_local(tmp_path, "", declared=None)  # the standalone script: only a declaration counts
    write_mark(tmp_path, "job-1")
    assert (tmp_path / MARK).read_text() == "job-1"
    assert not node_local(tmp_path, "job-1", declared=None)
    assert node_local(tmp_path, "job-2", declared=None)  # an earlier job's mark


def test_a_file_that_changes_while_copied_is_not_put_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, target = tmp_path / "ckpt.pt", tmp_path / "copy" / "ckpt.pt"
    source.write_bytes(b"first")
    real = shutil.copy2

    def rewritten_meanwhile(src: Path, dst: Path) -> object:
        done = real(src, dst)
        source.write_bytes(b"second, longer")  # a save rewritten in place during the copy
        return done

    monkeypatch.setattr(run_copy.shutil, "copy2", rewritten_meanwhile)
    assert not copy_file(source, target) and not target.exists()
    assert list(target.parent.iterdir()) == []  # no temporary file left
    monkeypatch.setattr(run_copy.shutil, "copy2", real)
    assert copy_file(source, target) and target.read_bytes() == b"second, longer"


def test_a_node_pushes_back_only_what_it_changed_not_what_it_restored(tmp_path: Path) -> None:
    """Node 1 restored rank 0's metrics and checkpoint, then wrote a file of its own: only that one
    goes into the copy, never its older restored files over rank 0's newer ones."""
    job, run = tmp_path / "job", tmp_path / "run"
    (job / RUN_COPY).mkdir(parents=True)
    (job / RUN_COPY / "metrics.jsonl").write_text("step 10\n")
    copy = RunCopy(job, run, node=1, host="n2", say=lambda line: None)
    copy.restore()
    copy.start()
    (job / RUN_COPY / "metrics.jsonl").write_text("step 10\nstep 20\n")  # rank 0's node, meanwhile
    (run / "shard-1.pt").write_bytes(b"node 1's own")
    copy.finish()
    assert (job / RUN_COPY / "metrics.jsonl").read_text() == "step 10\nstep 20\n"
    assert (job / RUN_COPY / "shard-1.pt").read_bytes() == b"node 1's own"


def test_a_restore_keeps_a_nodes_newer_log_and_replaces_an_older_one(tmp_path: Path) -> None:
    """The survivor logged steps past the copy's checkpoint (a retry resumes them from its memory and
    does not redo them): its newer log stays; a node's older log, or one it lacks, is the copy's."""
    job, run = tmp_path / "job", tmp_path / "run"
    (job / RUN_COPY).mkdir(parents=True)
    run.mkdir()
    (job / RUN_COPY / "metrics.jsonl").write_text("step 1\nstep 2\n")
    (run / "metrics.jsonl").write_text("step 1\nstep 2\nstep 3\n")
    copied_at = (job / RUN_COPY / "metrics.jsonl").stat().st_mtime_ns
    os.utime(run / "metrics.jsonl", ns=(copied_at + 1, copied_at + 1))  # written after the copy's
    RunCopy(job, run, node=0, host="n1", say=lambda line: None).restore()
    assert (run / "metrics.jsonl").read_text() == "step 1\nstep 2\nstep 3\n"
    an_hour_ago = copied_at - 3600 * 10**9
    os.utime(run / "metrics.jsonl", ns=(an_hour_ago, an_hour_ago))  # an earlier run's, older than the copy
    RunCopy(job, run, node=0, host="n1", say=lambda line: None).restore()
    assert (run / "metrics.jsonl").read_text() == "step 1\nstep 2\n"
