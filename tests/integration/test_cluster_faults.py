"""The failures real clusters throw, each with the real fault: the kernel's OOM killer in a memory
cgroup (v1 here; v2 where it is the one mounted), and a run dir on a small tmpfs that a checkpoint
fills. Under CI=true a machine where no memory cgroup or tmpfs can be made fails these tests."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gptlaunch.files import check_digest
from tests.conftest import missing_component
from tests.integration.conftest import FAST, launcher, only_job_id, run

LIMIT = 2 << 30  # bytes: the ranks and the launcher's processes take about 1 GiB before the hog grows
# Rank 1 takes memory until the kernel ends it (each block written: resident, not only reserved); the
# other ranks wait to be ended by torchrun.
HOG = """import os, time
held = []
while os.environ["RANK"] == "1":
    held.append(b"\\x01" * (64 << 20))
    time.sleep(0.02)
time.sleep(600)
"""


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A new memory cgroup limited to LIMIT bytes (v1, else v2): its directory. Its processes are
    killed and it is removed afterwards."""
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    group = None
    try:
        if (v1 / "memory.limit_in_bytes").is_file():
            group = v1 / f"gptlaunch-test-{os.getpid()}"
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(LIMIT))
        elif "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            group = v2 / f"gptlaunch-test-{os.getpid()}"
            group.mkdir()
            (group / "memory.max").write_text(str(LIMIT))
    except OSError as e:
        missing_component(f"cannot make a memory cgroup (root, cgroup v1 or v2 with memory): {e}")
    if group is None:
        missing_component("no memory cgroup controller is mounted (v1 or v2)")
    yield group
    deadline = time.monotonic() + 30
    while (pids := (group / "cgroup.procs").read_text().split()) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.1)
    group.rmdir()


def _oom_kills(group: Path) -> int:
    name = "memory.oom_control" if (group / "memory.oom_control").is_file() else "memory.events"
    counts = dict(line.split() for line in (group / name).read_text().splitlines())
    return int(counts["oom_kill"])


def test_a_rank_the_oom_killer_ends_is_named_out_of_memory_with_its_rss_and_the_limit(
    memory_cgroup: Path, tmp_path: Path
) -> None:
    """A local 2-node job run inside the cgroup, rank 1 taking memory: the kernel's OOM killer ends it
    (SIGKILL, which torchrun reports as any signal); the launcher names it out of memory, with the
    rank's last RSS seen and the cgroup's limit, on the console and in ``status``."""
    (tmp_path / "hog.py").write_text(HOG)
    jobs = tmp_path / "jobs"
    argv = [sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), "submit", "--nodes", "2"]
    argv += ["--workdir", str(tmp_path), "--", "hog.py"]
    joined = f'echo $$ > {memory_cgroup / "cgroup.procs"} && exec "$@"'  # the launcher and all it starts
    proc = run(["sh", "-c", joined, "sh", *argv], timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _oom_kills(memory_cgroup) >= 1  # the kernel's own count: the fault was real
    said = proc.stderr.splitlines()[-1]
    named = "node 1, rank 1 (local_rank 0) failed: out of host memory: the kernel's OOM killer ended rank 1"
    assert named in said, said
    sizes = re.search(r"its RSS ([\d.]+) GiB when last seen, the limit ([\d.]+) GiB", said)
    assert sizes is not None and float(sizes[2]) == LIMIT / 2**30, said
    assert 0 < float(sizes[1]) <= float(sizes[2]), said  # the hog's, as sampled: within the limit
    status = launcher(jobs, "status", only_job_id(jobs), check=True).stdout
    assert "exit code 1: " + named in status, status


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 30 MB tmpfs (FAST's checkpoints are 17.6 MB: one fits, two do not): its mount point."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = run(["mount", "-t", "tmpfs", "-o", "size=30M", "tmpfs", str(mount)])
    if made.returncode != 0:
        missing_component(f"cannot mount a tmpfs (root): {made.stderr.strip()}")
    yield mount
    run(["umount", "--lazy", str(mount)])


def test_a_checkpoint_that_does_not_fit_is_named_and_the_last_whole_one_resumed_once_there_is_room(
    prepared_data: list[str], small_fs: Path, tmp_path: Path
) -> None:
    """The run dir on a full file system: the save of step 20 does not fit (a warning, training goes
    on), nor does the last one at step 30, which ends the job with the cause in one line, not retried
    with ``--retries 2``; nothing is left half-written, ckpt-10 is whole, and once the file system has
    room the next submit resumes from it. Then, with the newest checkpoint cut to half its size, the
    next submit sets it aside (not deleted) and resumes from the one before."""
    jobs, run_dir = tmp_path / "jobs", small_fs / "run"
    argv = ["submit", "--nodes", "2", "--retries", "2", "--", *prepared_data, *FAST, "--max-steps", "30"]
    argv += ["--checkpoint-interval", "10", "--eval-interval", "100000", "--run-dir", str(run_dir)]
    full = launcher(jobs, *argv)
    assert full.returncode == 1, full.stderr[-3000:]
    said = full.stderr.splitlines()[-1]
    assert f"rank 0 (local_rank 0) failed: NoSpaceError: no space left on {run_dir}'s file system" in said
    sizes = re.search(r"the checkpoint of step 30 needs ([\d.]+) MB, ([\d.]+) MB free; the newest", said)
    assert sizes is not None and float(sizes[1]) > float(sizes[2]), said
    assert f"the newest whole checkpoint is {run_dir / 'ckpt-00000010.pt'}" in said
    assert "(attempt 1 of 3; not retried: the run dir's file system is full" in said, said
    warned = [line for line in full.stdout.splitlines() if "warning: no space left" in line]
    assert len(warned) == 1 and "checkpoint of step 20" in warned[0] and "training goes on" in warned[0]
    assert "Traceback" not in full.stdout + full.stderr  # the trainer's one line, not a stack
    status = launcher(jobs, "status", only_job_id(jobs), check=True).stdout
    assert "exit code 1: node 0, rank 0 (local_rank 0) failed: NoSpaceError: no space left" in status
    assert "last step 30 (the furthest any rank reached)" in status  # a finished job's step, too
    assert sorted(p.name for p in run_dir.glob("ckpt-*")) == ["ckpt-00000010.pt", "ckpt-00000010.pt.sha256"]
    assert not list(run_dir.glob(".*.tmp"))  # the failed writes' temporary files are gone
    ckpt = run_dir / "ckpt-00000010.pt"
    assert check_digest(ckpt)  # whole: the bytes it was written with
    run(["mount", "-o", "remount,size=80M", str(small_fs)], check=True)  # room for the next two
    again = launcher(jobs, *argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt} at step 10" in again.stdout
    # Then the newest checkpoint damaged (cut to half its size): the next run resumes from the one before.
    newest, whole = run_dir / "ckpt-00000030.pt", run_dir / "ckpt-00000020.pt"
    cut = newest.read_bytes()[: newest.stat().st_size // 2]
    newest.write_bytes(cut)
    assert check_digest(whole)  # the one a resume must use: whole, as written
    longer = launcher(jobs, *argv, "--max-steps", "40")
    assert longer.returncode == 0, longer.stderr[-3000:]
    aside = run_dir / "damaged" / newest.name
    said = f"checkpoint {newest.name} is damaged (checksum mismatch: sha256 "
    assert said in longer.stdout and f"moved to {aside}; resuming from {whole}" in longer.stdout
    assert f"resumed from {whole} at step 20" in longer.stdout
    assert aside.read_bytes() == cut  # set aside as found, never deleted
    recorded = (run_dir / "damaged" / f"{newest.name}.sha256").read_text().split()[0]
    assert hashlib.sha256(cut).hexdigest() != recorded  # what was found damaged: its checksum went along
