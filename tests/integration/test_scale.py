"""Many SSH hosts in one command: 8 test hosts (the CI's; the benchmark takes 16) train a tiny model in
one submit, with parity in one line for alike hosts and a console that shows rank 0 and every
node's warnings; and the ssh fan-out never runs more clients at once than ``--ssh-max-parallel``.
"""

from __future__ import annotations

import re
from pathlib import Path

from launcher.schedulers.ssh import client as ssh
from tests.integration.conftest import FAST, first_hosts, launcher, metrics, only_job_id

N = 8


def test_eight_hosts_train_in_one_submit_with_one_parity_line_and_a_rank_0_console(
    hostfile: Path, prepared_data: list[str], private: Path, tmp_path: Path
) -> None:
    hosts = first_hosts(hostfile, N, tmp_path)
    run_dir, jobs = private / "run", private / "jobs"  # share-nothing: the metrics come back as a copy
    proc = launcher(
        jobs, "submit", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", str(N),
        "--omp-num-threads", "1",  # N hosts share this machine's cores
        "--", *FAST, *prepared_data, "--preset", "tiny", "--max-steps", "3", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (parity,) = [line for line in proc.stderr.splitlines() if line.startswith("launcher: parity: ")]
    assert parity.startswith(f"launcher: parity: {N} host(s) gl-h1..gl-h{N} alike: "), parity
    assert [m["step"] for m in metrics(run_dir) if "loss" in m][-1] == 3
    assert f"world_size={N}" in proc.stdout
    # The console: rank 0's steps, no other rank's; every node's log still has its own lines.
    steps = [line for line in proc.stdout.splitlines() if re.search(r"\[rank\d+\]: step \d", line)]
    assert steps and all("[rank0]: step" in line for line in steps), steps
    assert "--tee all shows them here" in proc.stderr
    job_dir = jobs / only_job_id(jobs)
    for node in range(N):
        assert f"[rank{node}]:" in (job_dir / f"node-{node}.log").read_text()


def _wait_for_starts(log: Path, count: int) -> str:
    """A remote command that logs its start, waits (at most 10 s) until ``count`` commands have
    started, and logs its end: the clients that can run at once all overlap, whatever their timing."""
    wait = f"for i in $(seq 100); do [ $(grep -c start {log}) -ge {count} ] && break; sleep 0.1; done"
    return f"echo start >> {log}; {wait}; echo end >> {log}"


def _most_at_once(log: Path) -> int:
    running, most = 0, 0
    for event in log.read_text().split():
        running += 1 if event == "start" else -1
        most = max(most, running)
    return most


def test_the_fan_out_runs_at_most_max_parallel_clients_at_once(hostfile: Path, tmp_path: Path) -> None:
    """The hosts share this file system: each remote command logs its start and end in one file."""
    names = [line.split()[0] for line in first_hosts(hostfile, N, tmp_path).read_text().splitlines()]
    settings = ssh.SshSettings(max_parallel=3)
    capped, together = tmp_path / "capped", tmp_path / "together"
    results = ssh.fan_out(settings, names, lambda host: _wait_for_starts(capped, 3), timeout_s=60)
    assert all(r.ok for r in results), [r.error() for r in results if not r.ok]
    assert _most_at_once(capped) == 3
    results = ssh.fan_out(settings, names, lambda host: _wait_for_starts(together, N), 60, all_at_once=True)
    assert all(r.ok for r in results)
    assert _most_at_once(together) == N  # a collective's hosts wait for each other: no cap
