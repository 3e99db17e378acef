"""The node agent's reading of the kernel's OOM kill counts (``launcher.agent.memory``): which cgroup
files a node's process reads, v1 and v2, from ``/proc/self`` as the kernel writes it. (The real OOM
killer, in a real cgroup, is tests/integration/test_cluster_faults.py's.)"""

from __future__ import annotations

from pathlib import Path

from launcher.agent.memory import MemoryCgroup

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
