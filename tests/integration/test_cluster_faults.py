"""The failures real clusters throw, each with the real fault: the kernel's OOM killer in a memory
cgroup (v1 here; v2 where it is the one mounted). Under CI=true a machine where no memory cgroup can
be made fails these tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import missing_component
from tests.integration.conftest import launcher, only_job_id, run

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
