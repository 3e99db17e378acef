"""Which checkpoint a run resumes from (``trainer.resume``): real checkpoints written by
``checkpoint.save``, damaged on disk (truncated, one byte flipped), are caught before their weights are
used, set aside with their bytes intact, and the newest whole one is used, the same on every rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gptlaunch.files import digest_path
from trainer import checkpoint, resume
from trainer.distributed import DistEnv
from trainer.errors import CheckpointError

ONE = DistEnv()  # a single process: the collectives are the identity


def _state(step: int) -> dict:
    """A small model's weights and AdamW state after ``step`` optimizer steps, as a checkpoint holds."""
    torch.manual_seed(step)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(step):
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
    return {
        "format": checkpoint.FORMAT_VERSION,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
    }


def _save(run_dir: Path, *steps: int) -> dict[int, dict]:
    states = {step: _state(step) for step in steps}
    for step, state in states.items():
        checkpoint.save(state, run_dir, step, keep=len(steps) + 2)
    return states


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"]) and a["step"] == b["step"]


def test_a_truncated_newest_is_set_aside_whole_and_the_older_one_is_used(tmp_path: Path, capsys) -> None:
    states = _save(tmp_path, 10, 20)
    newest = checkpoint.checkpoint_path(tmp_path, 20)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    cut = newest.read_bytes()

    used = resume.first_whole(checkpoint.resume_candidates(tmp_path, "auto"), explicit=False, env=ONE)

    assert used == checkpoint.checkpoint_path(tmp_path, 10)
    assert _same(checkpoint.load(used, examined=True), states[10])
    aside = tmp_path / resume.DAMAGED_DIR / newest.name
    assert aside.read_bytes() == cut  # moved, never deleted: the bytes as found
    assert digest_path(aside).is_file() and not digest_path(newest).exists()  # its checksum went with it
    assert checkpoint.list_checkpoints(tmp_path) == [used]  # no longer a candidate
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1  # one line per fallback
    assert newest.name in err[0] and "checksum mismatch" in err[0]
    assert f"moved to {aside}" in err[0] and f"resuming from {used}" in err[0]


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_one_flipped_byte_anywhere_is_caught_before_the_weights_are_used(tmp_path: Path, where: str) -> None:
    states = _save(tmp_path, 10, 20)
    newest = checkpoint.checkpoint_path(tmp_path, 20)
    size = newest.stat().st_size
    _flip(newest, {"start": 0, "middle": size // 2, "end": size - 3}[where])

    with pytest.raises(CheckpointError, match=r"is damaged \(checksum mismatch"):
        checkpoint.load(newest)  # as ``trainer sample`` loads it: refused, not loaded
    used = resume.first_whole(checkpoint.resume_candidates(tmp_path, "auto"), explicit=False, env=ONE)

    assert used == checkpoint.checkpoint_path(tmp_path, 10)
    assert _same(checkpoint.load(used), states[10])
    assert (tmp_path / resume.DAMAGED_DIR / newest.name).is_file() and not newest.exists()


def test_an_old_checkpoint_without_a_checksum_still_loads_with_a_note(tmp_path: Path, capsys) -> None:
    states = _save(tmp_path, 10)
    old = checkpoint.checkpoint_path(tmp_path, 10)
    digest_path(old).unlink()  # as written before checkpoints carried one

    assert checkpoint.examine(old) == checkpoint.Verdict(None, checksummed=False)
    assert resume.first_whole([old], explicit=False, env=ONE) == old
    assert _same(checkpoint.load(old), states[10])
    out = capsys.readouterr()
    assert "has no checksum" in out.out and len(out.out.splitlines()) == 1 and not out.err


@pytest.mark.parametrize("damage", ["truncated", "flipped in a tensor"])
def test_an_old_checkpoint_without_a_checksum_is_checked_by_its_zip_crcs(tmp_path: Path, damage: str) -> None:
    states = _save(tmp_path, 10, 20)
    for step in (10, 20):
        digest_path(checkpoint.checkpoint_path(tmp_path, step)).unlink()
    newest = checkpoint.checkpoint_path(tmp_path, 20)
    data = newest.read_bytes()
    if damage == "truncated":
        newest.write_bytes(data[: len(data) // 2])
    else:  # in the weights' own bytes, which torch.load reads back without a complaint
        _flip(newest, data.index(states[20]["model"]["weight"].numpy().tobytes()) + 100)

    assert checkpoint.examine(newest).damage is not None
    assert resume.first_whole(checkpoint.resume_candidates(tmp_path, "auto"), explicit=False, env=ONE) == (
        checkpoint.checkpoint_path(tmp_path, 10)
    )


def test_with_no_whole_checkpoint_left_the_run_starts_afresh_naming_them(tmp_path: Path, capsys) -> None:
    _save(tmp_path, 10, 20)
    for step in (10, 20):
        _flip(checkpoint.checkpoint_path(tmp_path, step), 100)

    assert resume.first_whole(checkpoint.resume_candidates(tmp_path, "auto"), explicit=False, env=ONE) is None

    assert checkpoint.list_checkpoints(tmp_path) == []
    assert sorted(p.name for p in (tmp_path / resume.DAMAGED_DIR).glob("*.pt")) == [
        "ckpt-00000010.pt",
        "ckpt-00000020.pt",
    ]
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "ckpt-00000020.pt" in line and "ckpt-00000010.pt" in line and "starting at step 0" in line


def test_a_damaged_resume_path_is_an_error_naming_it_and_the_file_stays(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    path = checkpoint.checkpoint_path(tmp_path, 10)
    _flip(path, 100)
    before = path.read_bytes()

    with pytest.raises(CheckpointError) as excinfo:
        resume.first_whole(checkpoint.resume_candidates(tmp_path, str(path)), explicit=True, env=ONE)

    assert f"--resume {path}: is damaged (checksum mismatch" in str(excinfo.value)
    assert "--resume auto" in str(excinfo.value)
    assert path.read_bytes() == before and not (tmp_path / resume.DAMAGED_DIR).exists()


def test_rotation_neither_counts_nor_deletes_the_damaged_ones(tmp_path: Path) -> None:
    _save(tmp_path, 10, 20)
    _flip(checkpoint.checkpoint_path(tmp_path, 20), 100)
    assert resume.first_whole(checkpoint.resume_candidates(tmp_path, "auto"), explicit=False, env=ONE)
    # The step is saved again, and damaged again: the first damaged copy is kept as well.
    checkpoint.save(_state(20), tmp_path, 20, keep=2)
    _flip(checkpoint.checkpoint_path(tmp_path, 20), 100)
    assert resume.first_whole(checkpoint.resume_candidates(tmp_path, "auto"), explicit=False, env=ONE)
    for step in (30, 40):
        checkpoint.save(_state(step), tmp_path, step, keep=2)

    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "ckpt-00000030.pt",
        "ckpt-00000030.pt.sha256",
        "ckpt-00000040.pt",
        "ckpt-00000040.pt.sha256",
    ]
    assert sorted(p.name for p in (tmp_path / resume.DAMAGED_DIR).iterdir()) == [
        "ckpt-00000020.pt",
        "ckpt-00000020.pt.1",
        "ckpt-00000020.pt.1.sha256",
        "ckpt-00000020.pt.sha256",
    ]


def test_a_copy_damaged_on_another_node_only_is_left_in_place(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    path = checkpoint.checkpoint_path(tmp_path, 10)
    assert "on the node of rank 3" in resume._set_aside_phrase(path, [(3, "checksum mismatch")])
    assert path.is_file() and not (tmp_path / resume.DAMAGED_DIR).exists()  # rank 0's copy is whole


# ------------------------------------------------------------------ two ranks, one run dir each


def _rank(rank: int, store: str, nodes: str) -> None:
    """One rank on its own node: its cwd holds its own copy of the run dir ``run`` (node-local run
    dirs), which rank 0 names by the same relative path."""
    os.chdir(Path(nodes, f"node{rank}"))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    env = DistEnv(rank=rank, local_rank=0, world_size=2)
    try:
        said = [str(resume.first_whole(resume.candidates(Path("run"), "auto", env), explicit=False, env=env))]
        if rank == 0:  # node 1's ckpt-20 was damaged; now node 0's ckpt-10 is as well
            _flip(Path("run", "ckpt-00000010.pt"), 100)
        dist.barrier()
        said.append(
            str(resume.first_whole(resume.candidates(Path("run"), "auto", env), explicit=False, env=env))
        )
    finally:
        dist.destroy_process_group()
    Path(nodes, f"said{rank}").write_text("\n".join(said))


def test_every_rank_resumes_from_the_checkpoint_whole_on_every_node(tmp_path: Path, capfd) -> None:
    for node in (0, 1):
        _save(tmp_path / f"node{node}" / "run", 10, 20)
    _flip(tmp_path / "node1" / "run" / "ckpt-00000020.pt", 100)

    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)

    said = [(tmp_path / f"said{rank}").read_text().splitlines() for rank in (0, 1)]
    assert said[0] == said[1] == ["run/ckpt-00000010.pt", "None"]
    # Rank 0 moves its own damaged copies only; another node's stays where it is.
    assert [p.name for p in (tmp_path / "node0" / "run" / "damaged").glob("*.pt")] == ["ckpt-00000010.pt"]
    assert (tmp_path / "node0" / "run" / "ckpt-00000020.pt").is_file()
    assert len(list((tmp_path / "node1" / "run").glob("ckpt-*.pt"))) == 2
    assert "damaged on the node of rank 1" in capfd.readouterr().err
