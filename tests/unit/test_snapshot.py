"""In-memory snapshots (``gptlaunch.snapshots``): one writer per host, the newest snapshot wins over an
older checkpoint on disk, and a run's snapshots are dropped without touching another run dir's."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gptlaunch import runtime
from gptlaunch import snapshots as snapshots_module
from gptlaunch.contract import ATTEMPT_ENV, JOB_ID_ENV, RETRIES_ENV, SNAPSHOT_ROOT, job_snapshots
from gptlaunch.runtime import EXIT_CHECKPOINTED
from gptlaunch.snapshots import Offer, Snapshots, drop, drop_others, newest, source, writers
from trainer.run import Held, known_state, snapshot_on_failure


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


@pytest.fixture
def retry_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """The launcher's job with ``--retries 1``, its snapshots under ``tmp_path/job``: call it with the
    attempt (1: snapshots are kept; 2: they are read, and none kept)."""
    monkeypatch.setattr(runtime, "snapshot_dir", lambda run_dir: tmp_path / "job" / run_dir.name)
    monkeypatch.setenv(JOB_ID_ENV, "gpt-1")
    monkeypatch.setenv(RETRIES_ENV, "1")
    return lambda attempt: monkeypatch.setenv(ATTEMPT_ENV, str(attempt))


STATE = {"step": 10, "model": {"w": torch.arange(1000.0)}, "rng": [torch.zeros(3, dtype=torch.uint8)]}


def test_a_retry_resumes_from_the_snapshot_newer_than_the_disk_and_its_end_drops_it(
    tmp_path: Path, retry_of: Callable[[int], None]
) -> None:
    retry_of(1)
    with pytest.raises(RuntimeError), Snapshots(tmp_path / "run", every=10) as first:
        assert first.writer and first.due(10) and not first.due(5) and not first.due(0)
        first.keep(10, STATE)
        raise RuntimeError("a rank fails: the snapshot stays for the retry")
    assert newest(tmp_path / "job" / "run") == 10 and first.resume() is None  # attempt 1 reads none
    retry_of(2)
    with Snapshots(tmp_path / "run", every=10) as second:
        found = second.resume(newer_than=5)
        assert found is not None
        state, where = found
        assert torch.equal(state["model"]["w"], STATE["model"]["w"]) and state["step"] == 10
        assert where == f"the snapshot in {socket.gethostname()}'s memory"
        assert second.resume(newer_than=10) is None  # the disk's is as new: it is used
        second.keep(20, STATE)  # the last attempt keeps none
        assert newest(tmp_path / "job" / "run") == 10
    assert not (tmp_path / "job").exists()  # the run ended: dropped, and the job's directory with it


def test_a_stop_with_its_checkpoint_drops_the_snapshot_a_failure_keeps_it(
    tmp_path: Path, retry_of: Callable[[int], None]
) -> None:
    retry_of(1)
    for code, kept in ((EXIT_CHECKPOINTED, False), (1, True)):
        with pytest.raises(SystemExit), Snapshots(tmp_path / "run") as snapshots:
            snapshots.keep(10, STATE)
            raise SystemExit(code)
        assert (newest(tmp_path / "job" / "run") == 10) is kept


def test_the_last_state_is_written_before_keep_last_returns_after_the_write_in_flight(
    tmp_path: Path, retry_of: Callable[[int], None], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    retry_of(1)
    with pytest.raises(RuntimeError), Snapshots(tmp_path / "run") as snapshots:
        snapshots.keep(10, STATE)
        assert snapshots.keep_last(13, {**STATE, "step": 13})
        assert newest(tmp_path / "job" / "run") == 13  # written, and step 10's removed once step 13's is
        raise RuntimeError("a peer is lost: step 13's state stays for the retry")
    assert sorted(p.name for p in (tmp_path / "job" / "run").iterdir()) == [
        "snapshot-00000013.pt",
        "snapshot-00000013.pt.sha256",  # step 10's went with its snapshot
    ]
    retry_of(2)  # the last attempt keeps none, and says nothing of it
    with Snapshots(tmp_path / "run") as last:
        assert not last.keep_last(20, STATE)
    (tmp_path / "job" / "run").mkdir(parents=True)
    retry_of(1)
    with pytest.raises(RuntimeError), Snapshots(tmp_path / "run") as failing:
        (tmp_path / "job" / "run").rmdir()
        (tmp_path / "job" / "run").write_text("a file where the snapshots should go")
        assert not failing.keep_last(13, STATE)
        raise RuntimeError("the retry resumes from the disk")
    assert "the state of step 13 could not be kept in memory" in capsys.readouterr().err
    monkeypatch.setattr(snapshots_module, "HEADROOM_BYTES", 2**60)  # more than any machine has free
    with pytest.raises(RuntimeError), Snapshots(tmp_path / "full") as full:
        assert not full.keep_last(13, STATE)
        raise RuntimeError("no room: the retry resumes from an older snapshot")
    assert newest(tmp_path / "job" / "full") is None and "MB needed" in capsys.readouterr().err


def test_weights_that_are_not_finite_are_never_kept_on_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainer.run._state", lambda run, step, rng, cuda_rng: {"step": step})
    kept: list[int] = []
    model = torch.nn.Linear(2, 2)
    snapshots = SimpleNamespace(writer=True, keep_last=lambda step, _: kept.append(step))
    run = SimpleNamespace(
        held=Held(12, [torch.get_rng_state()]), start_step=0, model=model, device=torch.device("cpu"),
        env=SimpleNamespace(rank=0), snapshots=snapshots,
    )  # fmt: skip
    snapshot_on_failure(run)  # type: ignore[arg-type]
    assert kept == [12]  # finite: kept
    with torch.no_grad():
        model.weight[0, 0] = float("nan")  # an update that diverged, before any loss showed it
    snapshot_on_failure(run)  # type: ignore[arg-type]
    assert kept == [12]  # not again


def test_a_state_is_kept_on_a_failure_only_when_whole_newer_and_every_ranks_rng_known() -> None:
    torch.manual_seed(0)
    mine = torch.get_rng_state()
    gathered = [torch.zeros_like(mine), mine]  # rank 0's, then this rank's (1)
    assert known_state(Held(12, gathered), rank=1, start_step=10)
    assert not known_state(Held(None, gathered), rank=1, start_step=10)  # mid-update: torn
    assert not known_state(Held(10, gathered), rank=1, start_step=10)  # nothing newer than the start
    assert not known_state(Held(12, []), rank=1, start_step=10)  # no gather yet in this attempt
    torch.rand(1)  # dropout draws: the other ranks' streams moved too, and are unknown
    assert not known_state(Held(12, gathered), rank=1, start_step=10)


def test_a_run_that_is_not_a_retry_drops_a_leftover_of_its_own_directory(
    tmp_path: Path, retry_of: Callable[[int], None]
) -> None:
    """Bare torchrun names every run "none" unless told otherwise: a new run must not resume from an
    earlier run's snapshot once it restarts."""
    retry_of(1)
    (tmp_path / "job" / "run").mkdir(parents=True)
    torch.save(STATE, tmp_path / "job" / "run" / "snapshot-00000090.pt")
    with pytest.raises(RuntimeError), Snapshots(tmp_path / "run") as snapshots:
        assert newest(tmp_path / "job" / "run") is None
        snapshots.keep(10, STATE)
        raise RuntimeError("kept for the retry")
    assert newest(tmp_path / "job" / "run") == 10


def test_a_snapshot_that_cannot_be_read_is_skipped(
    tmp_path: Path, retry_of: Callable[[int], None], capsys
) -> None:
    retry_of(2)
    (tmp_path / "job" / "run").mkdir(parents=True)
    (tmp_path / "job" / "run" / "snapshot-00000020.pt").write_bytes(b"not a snapshot")
    with Snapshots(tmp_path / "run") as snapshots:
        assert snapshots.resume(newer_than=10) is None
        torch.save([STATE], tmp_path / "job" / "run" / "snapshot-00000030.pt")  # readable, not a state
        assert snapshots.resume(newer_than=10) is None
    err = capsys.readouterr().err
    assert "the snapshot of step 20" in err and "step 30 in" in err and "not a state (a list)" in err


def test_a_snapshot_whose_bytes_changed_since_its_write_is_skipped(
    tmp_path: Path, retry_of: Callable[[int], None], capsys
) -> None:
    retry_of(1)
    with pytest.raises(RuntimeError), Snapshots(tmp_path / "run") as first:
        first.keep(20, STATE)
        raise RuntimeError("a rank fails: the snapshot stays for the retry")
    path = tmp_path / "job" / "run" / "snapshot-00000020.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit rots in memory
    path.write_bytes(bytes(data))
    retry_of(2)
    with Snapshots(tmp_path / "run") as second:
        assert second.resume(newer_than=10) is None  # the disk's checkpoint instead
    err = capsys.readouterr().err
    assert "the snapshot of step 20" in err and "checksum mismatch" in err


def test_snapshots_are_best_effort_a_full_memory_or_a_failed_write_turns_them_off(
    tmp_path: Path, retry_of: Callable[[int], None], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    retry_of(1)
    monkeypatch.setattr(snapshots_module, "HEADROOM_BYTES", 2**60)  # more than any machine has free
    with pytest.raises(RuntimeError), Snapshots(tmp_path / "full") as full:
        full.keep(10, STATE)
        full.keep(20, STATE)  # off: not tried again, not said again
        raise RuntimeError("kept, were there one")
    assert newest(tmp_path / "job" / "full") is None
    assert capsys.readouterr().err.count("no more snapshots in memory for this run") == 1

    monkeypatch.setattr(snapshots_module, "HEADROOM_BYTES", 0)
    with Snapshots(tmp_path / "taken") as failing:  # leaving it raises nothing
        (tmp_path / "job" / "taken").rmdir()
        (tmp_path / "job" / "taken").write_text("a file where the snapshots should go")
        failing.keep(10, STATE)
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
