"""The node agent's reading of the kernel's OOM kill counts (``launcher.agent.memory``): which cgroup
files a node's process reads, v1 and v2, from ``/proc/self`` as the kernel writes it. (The real OOM
killer, in a real cgroup, is tests/integration/test_cluster_faults.py's.)"""

from __future__ import annotations

from pathlib import Path

from launcher.agent import memory
from launcher.agent.memory import MemoryCgroup, MemoryWatch

# /proc/self/mountinfo lines: "ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS ... - FSTYPE SOURCE SUPER"
V1 = "35 30 0:31 / {root}/memory rw,nosuid shared:14 - cgroup cgroup rw,memory\n"
V2 = "30 25 0:26 / {root} rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo.format(root=tmp_path / "sys"))
    return proc


def test_a_v1_memory_cgroup_is_read_from_oom_control_with_its_limit(tmp_path: Path) -> None:
    group = tmp_path / "sys" / "memory" / "slurm" / "job_7"
    group.mkdir(parents=True)
    (group / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (group / "memory.limit_in_bytes").write_text(f"{3 << 30}\n")
    proc = _proc(tmp_path, "5:cpu:/\n4:memory:/slurm/job_7\n0::/\n", V1)
    cgroup = MemoryCgroup.of_self(proc)
    assert cgroup is not None and (cgroup.kills(), cgroup.limit()) == (3, 3 << 30)
    (group / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup.limit() is None


def test_a_v2_cgroup_is_read_from_memory_events_and_max(tmp_path: Path) -> None:
    group = tmp_path / "sys" / "user.slice" / "job"
    group.mkdir(parents=True)
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    (group / "memory.max").write_text("max\n")
    cgroup = MemoryCgroup.of_self(_proc(tmp_path, "0::/user.slice/job\n", V2))
    assert cgroup is not None and (cgroup.kills(), cgroup.limit()) == (1, None)


def test_no_memory_controller_is_no_cgroup(tmp_path: Path) -> None:
    assert MemoryCgroup.of_self(_proc(tmp_path, "5:cpu:/\n0::/\n", V1)) is None


def test_a_kill_is_the_nodes_when_its_cgroups_count_rose_and_only_then(tmp_path: Path, monkeypatch) -> None:
    """The host's count rising alone is another process's kill (the kernel counts a host-wide kill in
    its victim's cgroup too); with no cgroup count to read, the host's is all there is."""
    proc = tmp_path / "proc"
    proc.mkdir()
    monkeypatch.setattr(memory, "_PROC", proc)
    (proc / "vmstat").write_text("pgfault 10\noom_kill 5\n")
    events = tmp_path / "memory.events"
    events.write_text("oom_kill 0\n")
    (tmp_path / "memory.max").write_text(f"{1 << 30}\n")
    node = MemoryWatch(cgroup=MemoryCgroup(events, tmp_path / "memory.max"))
    bare = MemoryWatch(cgroup=None)
    (proc / "vmstat").write_text("pgfault 10\noom_kill 6\n")  # someone's kill on the host
    assert node.killed() is None
    scope, kills, _ = bare.killed() or ("", 0, 0)
    assert (scope, kills) == ("host", 1)
    events.write_text("oom_kill 2\n")
    assert node.killed() == ("cgroup", 2, 1 << 30)
