"""Room for a checkpoint (``trainer.disk``): what a save needs, what is deleted to make room and what
never is, and a failed write's ENOSPC found behind torch's own error."""

from __future__ import annotations

import errno
import io
from pathlib import Path

import pytest
import torch

from gptlaunch.files import no_space
from gptlaunch.snapshots import storage_bytes
from trainer import checkpoint, disk
from trainer.errors import NoSpaceError


def test_a_storage_shared_or_viewed_counts_once_and_whole_as_torch_save_writes_it() -> None:
    shared = torch.zeros(1000)  # 4,000 bytes: tied weights, and a view of part of it
    state = {"embedding": shared, "head": shared, "part": shared[:10], "other": [torch.zeros(10)]}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert storage_bytes(state) == 4_040
    assert 4_040 < len(buffer.getvalue()) < 4_040 + 4_096  # the rest: the zip's headers and the pickle


class _FullDisk(io.RawIOBase):
    """A file whose writes fail with ``code`` after ``room`` bytes, as a full file system's do."""

    def __init__(self, room: int, code: int) -> None:
        self.room, self.code = room, code

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[no-untyped-def, override]
        if len(data) > self.room:
            raise OSError(self.code, "full")
        self.room -= len(data)
        return len(data)


def test_enospc_and_edquot_are_found_behind_torch_saves_own_error_and_no_other_error_is() -> None:
    for code in (errno.ENOSPC, errno.EDQUOT):
        with pytest.raises(RuntimeError) as raised:  # torch's "unexpected pos", raised while handling it
            torch.save({"w": torch.zeros(100_000)}, _FullDisk(1_000, code))
        found = no_space(raised.value)
        assert found is not None and found.errno == code
    with pytest.raises(RuntimeError) as raised:
        torch.save({"w": torch.zeros(100_000)}, _FullDisk(1_000, errno.EIO))
    assert no_space(raised.value) is None


def test_short_of_room_older_checkpoints_go_first_never_for_nothing_nor_the_newest(
    tmp_path: Path, monkeypatch
) -> None:
    # A 13 MB file system holding 4 MB checkpoints, as its free bytes would say (this machine's disk is
    # not this test's to fill: a real full one is the integration test's tmpfs).
    for step in (10, 20, 30):
        path = checkpoint.checkpoint_path(tmp_path, step)
        path.write_bytes(b"\0" * 4_000_000)
        path.with_name(path.name + ".sha256").write_text("")
    held = lambda: len(checkpoint.list_checkpoints(tmp_path))  # noqa: E731
    monkeypatch.setattr(disk, "free_bytes", lambda _: 13_000_000 - 4_000_000 * held())
    found = checkpoint.list_checkpoints(tmp_path)
    disk.make_room(found[:2], 4_500_000, tmp_path, step=40)  # 1 MB free: the oldest goes, then 5 MB
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [20, 30]
    assert not (tmp_path / "ckpt-00000010.pt.sha256").exists()  # with its digest
    with pytest.raises(NoSpaceError) as short:  # 5 MB free, and 4 MB more would not make 9.5 MB
        disk.make_room(checkpoint.list_checkpoints(tmp_path)[:1], 9_500_000, tmp_path, step=40)
    expected = "the checkpoint of step 40 needs 9.5 MB, 5.0 MB free"
    assert str(short.value) == f"no space left on {tmp_path}'s file system: {expected}"
    # Nothing deleted for nothing: ckpt-20 stays a fallback for a resume, and the newest stays always.
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [20, 30]


def test_a_write_that_failed_with_room_seemingly_left_says_it_needs_more_than_is_free() -> None:
    assert disk.describe(Path("/run"), 7, needed=5_000_000, free=6_000_000).endswith(
        "the checkpoint of step 7 needs more than the 6.0 MB free"
    )
    assert "over your quota on /run's" in disk.describe(Path("/run"), 7, 1, 0, "over your quota")
