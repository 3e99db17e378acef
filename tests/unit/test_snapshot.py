"""In-memory snapshots (``trainer.snapshot``): one writer per host, the newest snapshot wins over an
older checkpoint on disk, and a run's snapshots are dropped without touching another run dir's."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from gptlaunch import runtime
from gptlaunch.contract import ATTEMPT_ENV, JOB_ID_ENV, RETRIES_ENV, SNAPSHOT_ROOT, job_snapshots
from trainer import checkpoint, snapshot
from trainer.snapshot import Offer, Snapshots, drop, drop_others, from_memory, source, writers


def test_one_writer_per_host_the_lowest_rank_on_it() -> None:
    assert writers(["a", "a", "b", "b"]) == {0, 2}
    assert writers(["b", "a", "b"]) == {0, 1}


def test_the_newest_snapshot_is_chosen_only_when_newer_than_the_disk() -> None:
    offers = [Offer("a", 20), Offer("a", 20), Offer("b", None), Offer("c", 30)]
    assert source(offers, disk_step=None) == (3, 30)
    assert source(offers, disk_step=25) == (3, 30)
    assert source(offers, disk_step=30) is None  # the disk's is as new: it is used
    assert source([Offer("a", 20), Offer("b", 20)], disk_step=10) == (0, 20)  # the lowest rank among equals
    assert source([Offer("a", None)], disk_step=None) is None


def test_the_directory_is_the_jobs_then_the_run_dirs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(JOB_ID_ENV, "gpt-1")
    first = runtime.snapshot_dir(tmp_path / "run")
    assert first.parent == job_snapshots("gpt-1") and first == runtime.snapshot_dir(tmp_path / "run")
    assert first.is_relative_to(SNAPSHOT_ROOT)  # host memory: /dev/shm
    assert runtime.snapshot_dir(tmp_path / "other") != first
    monkeypatch.setenv(JOB_ID_ENV, "gpt-2")
    assert runtime.snapshot_dir(tmp_path / "run").name == first.name  # same run dir, another job


def test_a_new_job_drops_the_old_jobs_snapshots_of_its_run_dir_only(tmp_path: Path) -> None:
    old, other_run, mine = (
        tmp_path / "job-1" / "run",
        tmp_path / "job-1" / "elsewhere",
        tmp_path / "job-2" / "run",
    )
    for d in (old, other_run, mine):
        d.mkdir(parents=True)
    drop_others(mine)
    assert not old.exists() and other_run.is_dir() and mine.is_dir()
    drop(mine)
    assert not (tmp_path / "job-2").exists() and (tmp_path / "job-1").is_dir()


def test_a_keeper_that_keeps_none_writes_nothing_but_still_drops_the_older_jobs(tmp_path: Path) -> None:
    """The last attempt of a job: it may resume from a snapshot but keeps none (no retry follows)."""
    old, mine = tmp_path / "job-1" / "run", tmp_path / "job-2" / "run"
    old.mkdir(parents=True)
    with Snapshots(mine, torch.device("cpu"), keeping=False) as last:
        last.keep({"step": 10, "model": {"w": torch.zeros(4)}}, 10)
    assert not old.exists() and not mine.exists()


def test_a_snapshot_newer_than_the_disk_is_loaded_and_a_broken_one_is_skipped(tmp_path: Path, capsys) -> None:
    state = {"format": checkpoint.FORMAT_VERSION, "step": 20, "model": {"w": torch.arange(4.0)}}
    checkpoint.save(state, tmp_path, 20, keep=1)
    found = from_memory(tmp_path, rank=0, disk_step=10)
    assert found is not None
    loaded, where = found
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0))
    assert where == f"the snapshot in {socket.gethostname()}'s memory"
    assert from_memory(tmp_path, rank=0, disk_step=20) is None
    checkpoint.checkpoint_path(tmp_path, 20).write_bytes(b"not a checkpoint")
    assert from_memory(tmp_path, rank=0, disk_step=10) is None
    assert "the snapshot of step 20" in capsys.readouterr().err


def test_snapshots_are_best_effort_a_full_memory_or_a_failed_write_turns_them_off(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    state = {"step": 10, "model": {"w": torch.zeros(1000)}}
    with Snapshots(tmp_path / "roomy", torch.device("cpu")) as kept:
        kept.keep(state, 10)
    assert checkpoint.step_of(checkpoint.list_checkpoints(tmp_path / "roomy")[-1]) == 10

    monkeypatch.setattr(snapshot, "HEADROOM_BYTES", 2**60)  # more than any machine has free
    with Snapshots(tmp_path / "full", torch.device("cpu")) as full:
        full.keep(state, 10)
        full.keep(state, 20)  # off: not tried again, not said again
    assert not (tmp_path / "full").exists()
    assert capsys.readouterr().err.count("no more snapshots in memory for this run") == 1

    monkeypatch.setattr(snapshot, "HEADROOM_BYTES", 0)
    taken = tmp_path / "taken"
    taken.write_text("a file where the snapshots should go")
    with Snapshots(taken, torch.device("cpu")) as failing:  # leaving it raises nothing
        failing.keep(state, 10)
    assert "the last snapshot in memory could not be written" in capsys.readouterr().err


def test_snapshots_are_kept_only_when_a_retry_may_follow_and_read_only_by_a_retry(monkeypatch) -> None:
    for name in (
        JOB_ID_ENV,
        ATTEMPT_ENV,
        RETRIES_ENV,
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RESTART_COUNT",
    ):
        monkeypatch.delenv(name, raising=False)
    assert not runtime.may_retry() and not runtime.retried()  # a plain run: a stale snapshot is never read
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert runtime.may_retry() and not runtime.retried()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert runtime.retried()
    monkeypatch.setenv(JOB_ID_ENV, "gpt-1")  # the launcher's --retries 1: attempts 1 and 2
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.setenv(RETRIES_ENV, "1")
    monkeypatch.setenv(ATTEMPT_ENV, "1")
    assert runtime.may_retry() and not runtime.retried()
    monkeypatch.setenv(ATTEMPT_ENV, "2")
    assert not runtime.may_retry() and runtime.retried()  # the last attempt keeps none
