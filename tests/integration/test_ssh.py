"""The SSH scheduler, version parity and the network preflight against real sshd test hosts: network
namespaces on this machine, each with its own address, a veth link to a shared bridge and its own
sshd (``deploy/ssh/dev-hosts.sh``). The hosts share the checkout and the virtualenv (the code, as
if installed on each), but each sees its own directory at ``/var/lib/gptlaunch-ssh/local``: the jobs
that train run in share-nothing mode (the ``private`` fixture), their records on this machine only
and each host's run dir its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest

from gptlaunch.contract import job_snapshots, read_beats
from launcher.job import reports
from launcher.job.follow import wait_terminal
from launcher.job.plan import Plan
from launcher.job.record import Attempt, JobRecord
from launcher.job.reports import NodeStatus
from launcher.job.torchrun import zygote_name
from launcher.schedulers.ssh.scheduler import SshScheduler
from tests.integration.conftest import (
    FAST,
    PLAIN_ARGS,
    SSH_STATE,
    TINY,
    first_hosts,
    launcher,
    logged_step,
    make_other_venv,
    metrics,
    on_host,
    only_job_id,
    plain_project,
    processes_of,
    run,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
CANARY = "hf_canary_3f9d1e"


def host_names(hostfile: Path) -> list[str]:
    return [line.split()[0] for line in hostfile.read_text().splitlines() if line and line[0] != "#"]


def train_args(prepared_data: list[str], run_dir: Path, steps: int) -> list[str]:
    return [*FAST, *prepared_data, "--preset", "tiny", "--max-steps", str(steps), "--run-dir", str(run_dir)]


def test_two_hosts_that_share_no_files_train_over_their_veth_interfaces(
    hostfile: Path, wikitext_valid: Path, private: Path, tmp_path: Path
) -> None:
    """Share-nothing: each node prepares its own data in its own run dir, rank 0's host alone writes
    the checkpoints, and the launcher gets its copy of them (and of the metrics) over ssh."""
    hosts = first_hosts(hostfile, 2, tmp_path)
    # A run dir no shell may interpret: spaces, quotes, $(...) and backticks reach the hosts verbatim.
    run_dir = private / "run dir 'q' $(touch PWNED) `touch PWNED2`"
    jobs = private / "jobs"
    args = [*FAST, "--text-files", str(wikitext_valid), "--preset", "tiny", "--max-steps", "20"]
    proc = launcher(
        jobs, "submit", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2",
        "--gpus-per-node", "1", "--", *args, "--run-dir", str(run_dir), "--checkpoint-interval", "10",
        env={"HF_TOKEN": CANARY},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [m for m in metrics(run_dir) if "tokens_per_s" in m]  # the launcher's copy
    assert rows[-1]["step"] == 20 and {m["world_size"] for m in rows} == {2}
    assert (run_dir / "ckpt-00000020.pt").is_file(), sorted(p.name for p in run_dir.iterdir())
    names = host_names(hosts)
    holders = [h for h in names if (on_host(h, run_dir) / "ckpt-00000020.pt").is_file()]
    assert len(holders) == 1, holders  # rank 0's host wrote it; the other host never saw it
    assert all((on_host(h, run_dir) / "data" / "manifest.json").is_file() for h in names)  # its own data
    assert not list(tmp_path.rglob("PWNED*")) and not list(private.rglob("PWNED*")), "a shell ran"
    job = only_job_id(jobs)
    assert (jobs / job / "plan.json").is_file()
    assert not any(on_host(h, jobs / job / "plan.json").exists() for h in names)  # the record is here only
    plan = json.loads((jobs / job / "plan.json").read_text())
    assert [n["host"] for n in plan["nodes"]] == names
    for node in plan["nodes"]:  # the interface towards master_addr, chosen per host: the veth, never lo
        assert node["env"]["GLOO_SOCKET_IFNAME"] == node["env"]["NCCL_SOCKET_IFNAME"] == "eth0"
    assert plan["facts"]["master_addr"] == names[0]
    out = proc.stdout
    for k, name in enumerate(names):  # host-prefixed live output, and per-host logs in the record
        assert f"{name} node{k} | " in out
        assert (jobs / job / f"node-{k}.log").stat().st_size > 0
    record_text = "".join(p.read_text(errors="replace") for p in (jobs / job).rglob("*") if p.is_file())
    assert CANARY not in record_text
    assert not processes_of(job)
    # The report, from the job record and the launcher's copy of the run dir: the hosts share nothing.
    page = Path(launcher(jobs, "report", job, check=True).stdout.strip()).read_text()
    assert '<div id="chart-loss"' in page and '<div id="chart-each-ranks-throughput"' in page
    assert f"2 host(s) {names[0]}, {names[1]} alike: " in page.split("<pre id='parity'>")[1]
    assert "the job ran no health gate (--health-check)" in page


def test_the_plain_script_synced_to_hosts_that_share_no_files_trains_there(
    hostfile: Path, wikitext_valid: Path, private: Path, tmp_path: Path
) -> None:
    """``--sync``: the project reaches the workdir on each host's own disk, which neither this machine
    nor the other host sees; the job runs there, rank 0's checkpoint stays on its host, and the hosts'
    last beats (the steps ``status`` shows) reach the record here."""
    hosts, project = first_hosts(hostfile, 2, tmp_path), plain_project(tmp_path, wikitext_valid)
    workdir, jobs = private / "work", private / "jobs"
    proc = launcher(
        jobs, "submit", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2",
        "--gpus-per-node", "1", "--sync", str(project), "--workdir", str(workdir), "--", *PLAIN_ARGS,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    copies = [on_host(host, workdir) for host in host_names(hosts)]
    for host in host_names(hosts):  # one line per host: the script and its data
        assert f"launcher: sync: {host}: 2 file(s), 1.1 MB into {workdir}" in proc.stderr
    assert all((copy / "ddp_plain.py").is_file() for copy in copies)
    assert [(copy / "out" / "ckpt.pt").is_file() for copy in copies].count(True) == 1  # rank 0's host
    assert not workdir.exists()  # not on this machine
    assert "step 30/30" in proc.stdout
    job = only_job_id(jobs)
    beats = [b for k in (0, 1) for b in read_beats(jobs / job / "heartbeat" / f"node-{k}")]
    assert sorted(b.step for b in beats) == [30, 30]


def per_host_python(names: list[str], pythons: list[Path]) -> str:
    """One path, a different interpreter on each host: /var/lib/gptlaunch-ssh/local is host-local."""
    for name, python in zip(names, pythons, strict=True):
        wrapper = SSH_STATE / "hosts" / name / "local" / "python"
        wrapper.write_text(f'#!/bin/sh\nexec {python} "$@"\n')
        wrapper.chmod(0o755)
    return str(SSH_STATE / "local" / "python")


def test_version_mismatch_refuses_the_launch_with_a_diff(
    hostfile: Path, prepared_data: list[str], private: Path, tmp_path: Path
) -> None:
    hosts = first_hosts(hostfile, 2, tmp_path)
    other_python, other = make_other_venv(tmp_path)
    python = per_host_python(host_names(hosts), [Path(sys.executable), other_python])
    jobs = private / "jobs"
    proc = launcher(
        jobs, "submit", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2", "--python", python,
        "--", *train_args(prepared_data, private / "run", 5),
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-3000:]
    diff = proc.stderr
    assert "packages.tokenizers" in diff and version("tokenizers") in diff and other in diff
    assert "gl-h1" in diff and "gl-h2" in diff
    assert not jobs.exists() or not any(jobs.iterdir()), "nothing may be written for a refused launch"
    assert not (private / "run").exists()
    check = launcher(jobs, "check", "--hostfile", str(hosts), "--python", python)
    assert check.returncode == 3
    assert "packages.tokenizers" in check.stdout and other in check.stdout
    same = launcher(jobs, "check", "--hostfile", str(hosts), "--json")
    assert same.returncode == 0, same.stdout[-2000:] + same.stderr[-2000:]
    assert json.loads(same.stdout)["mismatches"] == []


def test_a_workdir_missing_on_one_host_refuses_the_launch_naming_that_host(
    hostfile: Path, private: Path, tmp_path: Path
) -> None:
    """The workdir made on gl-h1's own disk only."""
    hosts = first_hosts(hostfile, 2, tmp_path)
    first, second = host_names(hosts)
    workdir, jobs = private / "work", private / "jobs"
    on_host(first, workdir).mkdir(parents=True)
    proc = launcher(
        jobs, "submit", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2",
        "--workdir", str(workdir), "--", "--max-steps", "1",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"is not a directory on {second}:" in proc.stderr and "--workdir" in proc.stderr, proc.stderr
    assert not jobs.exists() or not any(jobs.iterdir()), "nothing may be written for a refused launch"


def test_check_probes_hosts_in_parallel(hostfile: Path, tmp_path: Path) -> None:
    """Each host's probe waits at a barrier until all eight have started: probes one after another
    never get past it (the first gives up after BARRIER_S and the check fails); probes at once all do.
    A structural check, where a timing ratio on a shared 2-core machine flaked."""
    hosts = first_hosts(hostfile, 8, tmp_path)
    names = host_names(hosts)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    python = per_host_python(names, [_barrier_python(barrier, n, len(names)) for n in names])
    proc = launcher(tmp_path, "check", "--hostfile", str(hosts), "--python", python, "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(json.loads(proc.stdout)["hosts"]) == sorted(names)
    assert sorted(p.name for p in barrier.iterdir()) == sorted(names)


BARRIER_S = 60  # well under the probe's own timeout, so a miss reads as this exit code, not a hang


def _barrier_python(barrier: Path, name: str, count: int) -> Path:
    """An interpreter wrapper that marks this host started, then waits until ``count`` have."""
    wrapper = barrier.parent / f"python-{name}"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"touch {barrier}/{name}\n"
        f"end=$(( $(date +%s) + {BARRIER_S} ))\n"
        f'while [ "$(ls {barrier} | wc -l)" -lt {count} ]; do\n'
        '  [ "$(date +%s)" -lt "$end" ] || exit 97\n'
        "  sleep 0.05\n"
        "done\n"
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def test_collective_preflight_reports_bandwidth_and_names_a_wrong_interface(
    hostfile: Path, tmp_path: Path
) -> None:
    hosts = first_hosts(hostfile, 2, tmp_path)
    proc = launcher(tmp_path, "check", "--hostfile", str(hosts), "--collective", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)["collective"]
    assert result["world_size"] == 2 and result["ifname"]["GLOO_SOCKET_IFNAME"] == "eth0"
    assert all(r["busbw_gbs"] > 0 for r in result["results"])
    started = time.monotonic()
    bad = launcher(
        tmp_path, "check", "--hostfile", str(hosts), "--collective", "--gloo-socket-ifname", "nosuch0",
        "--collective-timeout-s", "20",
    )  # fmt: skip
    took = time.monotonic() - started
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "the all_reduce across" in bad.stderr and "GLOO_SOCKET_IFNAME=nosuch0" in bad.stderr
    assert took < 20 + 60, f"the failing preflight took {took:.0f} s"


@pytest.mark.parametrize("victim", ["agent", "rank"])
def test_a_kill_on_host_2_ends_the_job_everywhere_and_names_host_2(
    victim: str, hostfile: Path, prepared_data: list[str], private: Path, tmp_path: Path
) -> None:
    """SIGKILL of host 2's torchrun agent, or of its rank: host 2 is the cause, not the healthy peer on
    host 1 that saw the connection close (its error file comes back over the agent's channel)."""
    hosts = first_hosts(hostfile, 2, tmp_path)
    run_dir, jobs = private / "run", private / "jobs"
    argv = [sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), "submit",
            "--scheduler", "ssh",
            "--hostfile", str(hosts), "--nodes", "2",
            "--", *train_args(prepared_data, run_dir, 100000)]  # fmt: skip
    submit = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"HF_TOKEN": CANARY},
    )
    try:
        wait_for(lambda: step_of(jobs) >= 1, 300, "training to start")
        job = only_job_id(jobs)
        ranks = [p for p in processes_of(job) if p.cmdline()[1:4] == ["-u", "-m", "trainer.cli"]]
        assert ranks and all(p.environ().get("HF_TOKEN") == CANARY for p in ranks)  # the secret arrived
        if victim == "agent":
            (agent,) = [p for p in processes_of(job) if _is_agent(p, node=1)]
            agent.kill()
        else:
            (rank,) = [p for p in ranks if p.environ().get("GPTLAUNCH_HOST_NODE") == "1"]
            rank.kill()
        _, err = submit.communicate(timeout=90)
    finally:
        if submit.poll() is None:
            submit.kill()
    assert submit.returncode not in (0, None)
    assert "host gl-h2" in err, err[-3000:]
    wait_for(lambda: not processes_of(job), 60, "every process of the job to end")
    status = json.loads((jobs / job / "status.json").read_text())
    assert status["state"] == "failed" and status["failure"]["host"] == "gl-h2", status
    if victim == "rank":
        assert status["failure"]["rank"] == 1 and "killed by SIGKILL" in status["failure"]["error"], status


FAILING = """
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("rank 1 gives up")
dist.barrier()
"""


def test_a_ranks_error_on_a_host_that_shares_no_files_comes_back_as_its_error_file(
    hostfile: Path, private: Path, tmp_path: Path
) -> None:
    """A script's rank 1 raises: its torchelastic error file (written by the shim), on its own host's
    disk, reaches the record here over the agent's channel, and the root cause quotes it."""
    hosts, project = first_hosts(hostfile, 2, tmp_path), tmp_path / "project"
    project.mkdir()
    (project / "fail.py").write_text(FAILING)
    jobs = private / "jobs"
    proc = launcher(
        jobs, "submit", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2",
        "--sync", str(project), "--workdir", str(private / "work"), "--", "fail.py",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    job = only_job_id(jobs)
    errors = [p.read_text() for p in (jobs / job / "torchelastic").rglob("error.json")]  # the peer's too
    assert any("rank 1 gives up" in text for text in errors), errors
    status = json.loads((jobs / job / "status.json").read_text())
    assert status["state"] == "failed" and status["failure"]["rank"] == 1, status
    assert "RuntimeError: rank 1 gives up" in status["message"], status["message"]


def _is_agent(proc: psutil.Process, node: int) -> bool:
    try:
        return (
            proc.environ().get("GPTLAUNCH_HOST_NODE") == str(node)
            and "launcher.agent.torchrun" in proc.cmdline()  # torchrun, run by the agent's python
        )
    except psutil.Error:
        return False


def test_unknown_or_changed_host_key_and_unreachable_host_are_refused(hostfile: Path, tmp_path: Path) -> None:
    unknown = launcher(tmp_path, "check", "--hosts", "gl-h1", "--ssh-opt", "UserKnownHostsFile=/dev/null")
    assert unknown.returncode == 2 and "not in known_hosts" in unknown.stderr, unknown.stderr
    key = tmp_path / "other_key"
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    known = tmp_path / "known_hosts"
    known.write_text("gl-h1 " + " ".join(key.with_suffix(".pub").read_text().split()[:2]) + "\n")
    changed = launcher(tmp_path, "check", "--hosts", "gl-h1", "--ssh-opt", f"UserKnownHostsFile={known}")
    assert changed.returncode == 2 and "CHANGED" in changed.stderr, changed.stderr
    started = time.monotonic()
    gone = launcher(tmp_path, "check", "--hosts", "10.231.0.250", "--ssh-connect-timeout-s", "3")
    assert gone.returncode == 2 and "10.231.0.250" in gone.stderr and "unreachable" in gone.stderr, (
        gone.stderr
    )
    assert time.monotonic() - started < 3 + 15


@pytest.mark.parametrize(
    "hosts", ["gl-h1;touch {tmp}/PWNED", "-oProxyCommand=touch {tmp}/PWNED", "gl-h1,$(touch {tmp}/PWNED)"]
)
def test_hostile_host_names_are_rejected(hosts: str, tmp_path: Path) -> None:
    for command in ("check", "submit"):
        extra = ["--scheduler", "ssh"] if command == "submit" else []
        proc = launcher(tmp_path, command, *extra, f"--hosts={hosts.format(tmp=tmp_path)}")
        assert proc.returncode == 2 and "is not a host name" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("PWNED*"))


def test_a_stopped_rank_on_host_2_is_a_hang_named_by_the_host_agents(
    hostfile: Path, prepared_data: list[str], private: Path, tmp_path: Path
) -> None:
    """Each host agent watches its own ranks' heartbeats; both report, the launcher names rank 1 on
    gl-h2 and keeps every rank's stack in the job record."""
    hosts = first_hosts(hostfile, 2, tmp_path)
    run_dir, jobs = private / "run", private / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2",
        "--hang-timeout-s", "10", "--", *train_args(prepared_data, run_dir, 100000),
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job = only_job_id(jobs)
    wait_for(lambda: step_of(jobs) >= 3, 300, "step 3")
    # `launcher status` asks each host's agent for its ranks' heartbeats.
    nodes = json.loads(launcher(jobs, "status", "--json", job, check=True).stdout)["nodes"]
    assert [(n["node_rank"], n["host"], n["ranks"]) for n in nodes] == [(0, "gl-h1", 1), (1, "gl-h2", 1)], (
        nodes
    )
    assert all(n["step"] >= 1 and n["heartbeat_age_s"] < 10 and n["stalled_s"] is None for n in nodes), nodes
    (rank1,) = [
        p for p in processes_of(job)
        if p.cmdline()[1:4] == ["-u", "-m", "trainer.cli"] and p.environ().get("GPTLAUNCH_HOST_NODE") == "1"
    ]  # fmt: skip
    rank = int(rank1.environ()["RANK"])  # c10d hands out ranks in the order the nodes join
    frozen = time.monotonic()
    rank1.suspend()  # SIGSTOP
    try:
        final = wait_terminal(SshScheduler(), JobRecord(jobs / job), 10 + 120, poll_s=0.2)
    finally:
        with contextlib.suppress(psutil.Error):
            rank1.resume()
    took = time.monotonic() - frozen
    assert final is not None and final.state == "failed", final
    assert f"rank {rank} (node 1, gl-h2) is stopped (SIGSTOP?)" in final.message, final.message
    # What the healthy peer waits in is asserted by the local test: a peer caught spinning may show no
    # Python frame. Here: the suspect, and a stack taken of every rank on its own host.
    stacks = {p.name: p.read_text() for p in (jobs / job / "hang").iterdir()}
    assert sorted(stacks) == sorted([f"node0-rank{1 - rank}.txt", f"node1-rank{rank}.txt"])
    assert all(text.count("Process ") >= 1 and "Python v" in text for text in stacks.values()), stacks
    wait_for(lambda: not processes_of(job), 60, "every process of the job to end")
    print(f"\n{final.message}\nreported {took:.1f} s after the freeze")


def test_a_hang_that_names_ranks_on_two_hosts_is_retried_on_two_spares(
    hostfile: Path, prepared_data: list[str], private: Path, tmp_path: Path
) -> None:
    """4 hosts in the hostfile, 2 nodes, --retries 1: the rank on each of the job's hosts is stopped
    (SIGSTOP) past step 3, so the hang names both; attempt 2 runs on the spares gl-h3 and gl-h4, one
    for each failed host in the hostfile's order, to --max-steps."""
    hosts = first_hosts(hostfile, 4, tmp_path)
    run_dir, jobs = private / "run", private / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2",
        "--retries", "1", "--retry-backoff-s", "0", "--hang-timeout-s", "10",
        "--", *train_args(prepared_data, run_dir, 12),
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job = only_job_id(jobs)
    wait_for(lambda: step_of(jobs) >= 3, 300, "step 3")
    ranks = [p for p in processes_of(job) if p.cmdline()[1:4] == ["-u", "-m", "trainer.cli"]]
    assert sorted(p.environ()["GPTLAUNCH_HOST_NODE"] for p in ranks) == ["0", "1"], ranks
    for rank in ranks:
        rank.suspend()  # SIGSTOP
    try:
        final = wait_terminal(SshScheduler(), JobRecord(jobs / job), 300, poll_s=0.5)
    finally:
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.resume()
    assert final is not None and final.state == "succeeded", final
    (first,) = json.loads((jobs / job / "status.json").read_text())["attempts"]
    assert first["replaced"] == {"gl-h1": "gl-h3", "gl-h2": "gl-h4"}, first
    assert "(node 0, gl-h1) is stopped" in first["cause"] and "(node 1, gl-h2) is stopped" in first["cause"]
    attempt_2 = json.loads((jobs / job / "plan.json").read_text())
    assert [n["host"] for n in attempt_2["nodes"]] == ["gl-h3", "gl-h4"], attempt_2["nodes"]
    assert max(m["step"] for m in metrics(run_dir) if "tokens_per_s" in m) == 12
    wait_for(lambda: not processes_of(job), 60, "every process of the job to end")
    print(f"\n{first['cause']}")


def _past_step_12_with_a_spare(
    hostfile: Path,
    prepared_data: list[str],
    private: Path,
    tmp_path: Path,
    retries: int,
    *flags: str,
    submit_flags: tuple[str, ...] = (),
) -> str:
    """A detached job of 40 steps (a checkpoint every 10, unless ``flags``, the trainer's, say else) on
    2 of 3 hosts that share no files, with ``retries`` and ``submit_flags``; its id once it has logged
    step 12 (into ``private/run`` on each host; the record and the copy of the checkpoints in
    ``private/jobs`` and ``private/run`` here)."""
    hosts = first_hosts(hostfile, 3, tmp_path)
    run_dir, jobs = private / "run", private / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2",
        "--retries", str(retries), "--retry-backoff-s", "1", *submit_flags,
        "--", *train_args(prepared_data, run_dir, 40), *TINY,  # steps that outlast rsync's 1 s mtimes
        "--checkpoint-interval", "10", "--eval-interval", "100000", *flags,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    wait_for(lambda: step_of(jobs) >= 12, 300, "step 12")
    return only_job_id(jobs)


def step_of(jobs: Path) -> int:
    """The furthest step logged by the one job in ``jobs`` (0 before it exists)."""
    found = list(jobs.iterdir()) if jobs.is_dir() else []
    return logged_step(found[0]) if found else 0


def test_a_killed_rank_on_host_2_is_retried_on_the_spare_host_3(
    hostfile: Path, prepared_data: list[str], private: Path, tmp_path: Path
) -> None:
    """3 hosts in the hostfile, 2 nodes, --retries 2, --warm-workers: attempt 2 runs on gl-h1 and the
    spare gl-h3 from the checkpoint and completes exactly --max-steps steps, each logged once; gl-h2
    keeps nothing. Both of attempt 2's ranks are forked from their hosts' zygotes (gl-h3's made ready
    while attempt 1 ran), which end with the job."""
    run_dir, jobs = private / "run", private / "jobs"
    warm = ("--warm-workers",)
    job = _past_step_12_with_a_spare(hostfile, prepared_data, private, tmp_path, 2, submit_flags=warm)
    follow = [sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), "logs", "-f", job]
    follower = subprocess.Popen(follow, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    logs = {host: jobs / job / f"warm-{host}.log" for host in ("gl-h1", "gl-h3")}
    ready = lambda: all(p.exists() and "ready on @" in p.read_text() for p in logs.values())  # noqa: E731
    wait_for(ready, 120, "the zygotes of gl-h1 and the spare gl-h3")
    (rank,) = _ranks_on("gl-h2")
    rank.kill()
    final = wait_terminal(SshScheduler(), JobRecord(jobs / job), 300, poll_s=0.5)
    assert final is not None and final.state == "succeeded", final
    # a follower that started before the replacement labels node 1's new lines with the spare's name
    labels = {line.split(" | ")[0] for line in follower.communicate(timeout=120)[0].splitlines()}
    assert {"gl-h2 node1", "gl-h3 node1"} <= labels, labels
    (first,) = final.attempts
    assert first.replaced == {"gl-h2": "gl-h3"} and "killed by SIGKILL" in first.cause, first
    assert first.step is not None and first.step >= 12, first  # the hosts' beats, kept in the record
    # The agents' last reports (what spares the launcher asking for beats, and signalling, over ssh):
    # the failed node's, with its rank's last beat, and both of attempt 2's. (Attempt 1's node 0, ended
    # by the launcher, may be killed before it reports: it is then asked over ssh.)
    last = [r for r in reports.read(jobs / job, NodeStatus) if not r.running]
    assert last[0].node == 1 and last[0].exit_code != 0, last
    # Beats are written at most twice a second: the killed rank's last one may trail the step 12
    # that rank 0 logged, so what can be asserted is that it is rank 1's and no later than the record.
    assert [b.rank for b in last[0].beats] == [1] and 1 <= last[0].beats[0].step <= first.step, last
    assert sorted((r.node, r.exit_code) for r in last[-2:]) == [(0, 0), (1, 0)], last
    assert [n.host for n in JobRecord(jobs / job).plan().nodes] == ["gl-h1", "gl-h3"]
    before = Plan.model_validate_json((jobs / job / "attempts" / "1" / "plan.json").read_text())
    assert [n.host for n in before.nodes] == ["gl-h1", "gl-h2"]
    assert [m["step"] for m in metrics(run_dir) if "tokens_per_s" in m] == list(range(1, 41))
    text = launcher(jobs, "status", job, check=True).stdout
    assert "attempt 2 of 3" in text and "gl-h2 → replaced by gl-h3" in text, text
    goodput = json.loads(launcher(jobs, "status", "--json", job, check=True).stdout)["goodput"]
    assert goodput["failures"] == 1 and goodput["lost_s"] > 1 and goodput["training_s"] > 0, goodput
    assert "(attempt 2, rank 0)" in logs["gl-h1"].read_text()  # forked, not started cold
    assert "(attempt 2, rank 1)" in logs["gl-h3"].read_text()
    wait_for(lambda: not processes_of(job), 60, "every process of the job to end")
    wait_for(lambda: not _zygotes_of(job), 60, "the job's zygotes to end")
    assert not [r for host in ("gl-h1", "gl-h2", "gl-h3") for r in _ranks_on(host)]
    print(f"\n{text}")


def _ranks_on(host: str) -> list[psutil.Process]:
    """The trainer's ranks on dev host ``host``: cold, or forked from a zygote (whose environment a
    forked rank's /proc shows, so only its title and network namespace tell it)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            line = " ".join(proc.cmdline())
            if "-m trainer.cli" in line and "gptlaunch.warm" not in line and "launcher.agent" not in line:
                found += [proc] if _on_host(proc, host) else []
    return found


def _zygotes_of(job: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            found += [proc] if zygote_name(job) in proc.cmdline() else []
    return found


def _on_host(proc: psutil.Process, host: str) -> bool:
    """Whether ``proc`` runs on dev host ``host`` (in its network namespace)."""
    try:
        return os.stat(f"/proc/{proc.pid}/ns/net").st_ino == os.stat(f"/run/netns/{host}").st_ino
    except OSError:
        return False


@contextlib.contextmanager
def _cut_off(host: str, job: str) -> Iterator[float]:
    """Dev host ``host``'s link down for the block (``ip link set glvK down``: no packet in or out),
    yielding when it went down (monotonic); before it comes back up, the block waits for the host's
    agent to end its node, having heard nothing from the launcher."""
    link = f"glv{host.removeprefix('gl-h')}"
    run(["ip", "link", "set", link, "down"], check=True)
    try:
        yield time.monotonic()
        wait_for(lambda: not any(_on_host(p, host) for p in processes_of(job)), 60, f"{host}'s node to end")
    finally:
        run(["ip", "link", "set", link, "up"], check=True)


def _logs(job_dir: Path) -> str:
    """The node logs of the job's current attempt."""
    return "".join(p.read_text(errors="replace") for p in job_dir.glob("node-*.log"))


def _the_one_failed_attempt(job_dir: Path) -> Attempt:
    """Once the job succeeded, its one failed attempt."""
    final = wait_terminal(SshScheduler(), JobRecord(job_dir), 300, poll_s=0.5)
    assert final is not None and final.state == "succeeded", final
    (first,) = final.attempts
    return first


def test_the_host_holding_the_checkpoint_is_lost_and_the_spare_resumes_from_the_launchers_copy(
    hostfile: Path, prepared_data: list[str], private: Path, tmp_path: Path
) -> None:
    """Share-nothing, 3 hosts in the hostfile, 2 nodes, --retries 1: the link of the host that holds
    rank 0 and its checkpoints is taken down mid-run (``ip link set glvK down``: no packet in or out).
    The job continues on the spare gl-h3 within 90 s from the launcher's copy of the last checkpoint,
    not from step 0, and ends at exactly --max-steps; the lost host's agent, which hears nothing from
    the launcher, ends its node, so when the link comes back nothing of the job runs there."""
    run_dir, jobs = private / "run", private / "jobs"
    job = _past_step_12_with_a_spare(hostfile, prepared_data, private, tmp_path, retries=1)
    wait_for(lambda: (run_dir / "ckpt-00000010.pt").is_file(), 60, "the launcher's copy of step 10")
    names = [n.host for n in JobRecord(jobs / job).plan().nodes]
    (lost,) = [h for h in names if (on_host(h, run_dir) / "ckpt-00000010.pt").is_file()]  # rank 0's host
    node = names.index(lost)
    assert any(_on_host(p, lost) for p in processes_of(job))
    with _cut_off(lost, job) as down:
        wait_for(
            lambda: "resumed from" in _logs(jobs / job) and step_of(jobs) >= 11, 90, "attempt 2's first step"
        )
        took = time.monotonic() - down
    first = _the_one_failed_attempt(jobs / job)
    assert first.replaced == {lost: "gl-h3"} and f"ssh connection to node {node}" in first.cause, first
    resumed = [
        int(step)
        for step in re.findall(
            rf"resumed from {re.escape(str(run_dir))}/ckpt-\d+\.pt at step (\d+)", _logs(jobs / job)
        )
    ]
    assert resumed and resumed[0] >= 10, _logs(jobs / job)[
        -3000:
    ]  # the copy of the last checkpoint, not step 0
    assert [m["step"] for m in metrics(run_dir) if "tokens_per_s" in m] == list(range(1, 41))
    assert not any(_on_host(p, lost) for p in processes_of(job))  # the link is back: still nothing
    agent_log = run(
        ["ssh", lost, f"cat $XDG_STATE_HOME/gptlaunch/jobs/{job}/node-{node}.log"], check=True
    ).stdout
    assert "agent: no word from the launcher for 30 s" in agent_log, agent_log[-2000:]
    print(f"\ncontinued on the spare {took:.0f} s after the link went down, from step {resumed[0]}")


def _snapshots_on(host: str, job: str) -> list[str]:
    """The in-memory snapshot files of ``job`` in dev host ``host``'s own /dev/shm."""
    listed = run(["ssh", host, f"ls {job_snapshots(job)}/*/ 2>/dev/null || true"], check=True).stdout
    return [name for name in listed.split() if name.endswith(".pt")]


def test_rank_0s_host_is_cut_off_and_the_spare_resumes_from_the_snapshot_in_the_peers_memory(
    hostfile: Path, prepared_data: list[str], private: Path, tmp_path: Path
) -> None:
    """Share-nothing, each host with its own /dev/shm, no checkpoint on disk before step 100, a
    snapshot in memory every 5 steps, 3 hosts in the hostfile, 2 nodes, --retries 1: the link of rank
    0's host goes down past step 12. The next attempt runs on the surviving host and the spare gl-h3,
    from the snapshot in the survivor's memory (not from step 0, and no disk holds a checkpoint), to
    exactly --max-steps; the lost host's agent drops its snapshot, and at the end no host keeps one."""
    run_dir, jobs = private / "run", private / "jobs"
    flags = ("--checkpoint-interval", "100", "--snapshot-interval", "5")
    job = _past_step_12_with_a_spare(hostfile, prepared_data, private, tmp_path, 1, *flags)
    names = [n.host for n in JobRecord(jobs / job).plan().nodes]
    (lost,) = [h for h in names if (on_host(h, run_dir) / "metrics.jsonl").is_file()]  # rank 0's host
    (survivor,) = set(names) - {lost}
    newest = f"snapshot-{10:08d}.pt"  # a rank that exits keeps its newest whole one, or an older one
    wait_for(lambda: all(max(_snapshots_on(h, job), default="") >= newest for h in names), 60, "step 10's")
    with _cut_off(lost, job):
        wait_for(lambda: "resumed from" in _logs(jobs / job), 120, "attempt 2's resume")
    first = _the_one_failed_attempt(jobs / job)
    assert first.replaced == {lost: "gl-h3"}, first
    resumed = [
        int(step)
        for step in re.findall(
            rf"resumed from the snapshot in {survivor}'s memory at step (\d+)", _logs(jobs / job)
        )
    ]
    assert resumed and resumed[0] >= 10, _logs(jobs / job)[-3000:]
    # At most two intervals redone: the newest snapshot, or the one before it when the survivor's
    # rank was killed while writing the newest.
    assert first.step is not None and first.step - resumed[0] <= 2 * 5, (first, resumed)
    agent_log = run(["ssh", lost, f"cat $XDG_STATE_HOME/gptlaunch/jobs/{job}/node-*.log"], check=True).stdout
    assert "agent: dropped this host's snapshots of the job from memory" in agent_log, agent_log[-2000:]
    assert max(m["step"] for m in metrics(run_dir) if "tokens_per_s" in m) == 40
    assert all(_snapshots_on(h, job) == [] for h in [*names, "gl-h3"])  # the lost host's included
    print(
        f"\nresumed from the snapshot of step {resumed[0]} in {survivor}'s memory; "
        f"attempt 1 reached step {first.step}"
    )


def test_a_retry_without_the_newest_checkpoint_fails_naming_where_it_is(
    hostfile: Path, prepared_data: list[str], private: Path, tmp_path: Path
) -> None:
    """Never a silent restart: this machine's copy of the run dir refuses every write (``chattr +i``,
    as a full disk would), so rank 0's checkpoints exist on its host only. A rank killed after step
    12 ends the job with a message that names the checkpoint, its host and the fix, and no attempt 2
    starts from step 0."""
    run_dir = private / "run"
    run_dir.mkdir()
    run(["chattr", "+i", str(run_dir)], check=True)
    try:
        job = _past_step_12_with_a_spare(hostfile, prepared_data, private, tmp_path, retries=1)
        names = [n.host for n in JobRecord(private / "jobs" / job).plan().nodes]
        (holder,) = [h for h in names if (on_host(h, run_dir) / "ckpt-00000010.pt").is_file()]
        (rank,) = [p for p in processes_of(job) if p.cmdline()[1:4] == ["-u", "-m", "trainer.cli"]
                   and p.environ().get("GPTLAUNCH_HOST_NODE") == str(1 - names.index(holder))]  # fmt: skip
        rank.kill()
        final = wait_terminal(SshScheduler(), JobRecord(private / "jobs" / job), 300, poll_s=0.5)
    finally:
        run(["chattr", "-i", str(run_dir)], check=True)
    assert final is not None and final.state == "failed", final
    message = final.message
    assert "attempt 2 of 2 could not be prepared" in message and "does not start over" in message, message
    assert (
        "ckpt-00000010.pt" in message and f"saved on {holder}" in message and "--allow-start-over" in message
    )
    assert f"rsync -a {holder}:{run_dir}/ {run_dir}/" in message, message
    assert not (private / "jobs" / job / "attempts").exists() and not final.attempts  # no attempt 2 ran
    wait_for(lambda: not processes_of(job), 60, "every process of the job to end")
    print(f"\n{message}")


def test_the_plain_scripts_checkpoint_host_fails_and_the_spare_resumes_from_the_launchers_copy(
    hostfile: Path, wikitext_valid: Path, private: Path, tmp_path: Path
) -> None:
    """The plain example script (no API) in share-nothing mode, ``--out {{run_dir}}`` and
    ``--resume-args``, 3 hosts in the hostfile, 2 nodes, --retries 1: the rank on the host that holds
    rank 0's checkpoint is SIGKILLed; attempt 2 runs on the spare gl-h3, which gets the launcher's copy
    of the checkpoint first, and resumes from it, not from step 0, to the script's last step. The
    spare was made ready (synced, probed) while attempt 1 ran, before any failure."""
    hosts, project = first_hosts(hostfile, 3, tmp_path), plain_project(tmp_path, wikitext_valid)
    workdir, jobs = private / "work", private / "jobs"
    submit = launcher(
        jobs, "submit", "--detach", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2",
        "--sync", str(project), "--workdir", str(workdir), "--retries", "1",
        "--retry-backoff-s", "1", "--resume-args=--init-from=resume",
        "--", "ddp_plain.py", "--data", "input.txt", "--steps", "2000", "--checkpoint-every", "100",
        "--out", "{{run_dir}}",
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job = only_job_id(jobs)
    run_dir = JobRecord(jobs / job).plan().run_dir
    wait_for(
        lambda: (Path(run_dir) / "ckpt.pt").is_file() and step_of(jobs) >= 110, 300, "the copy of step 100"
    )
    supervisor_log = jobs / job / "supervisor.log"
    wait_for(lambda: "spare host(s) ready" in supervisor_log.read_text(), 60, "the spare made ready")
    assert (on_host("gl-h3", workdir) / "ddp_plain.py").is_file()  # synced before any failure
    names = [n.host for n in JobRecord(jobs / job).plan().nodes]
    (holder,) = [h for h in names if (on_host(h, Path(run_dir)) / "ckpt.pt").is_file()]
    (rank,) = [p for p in processes_of(job) if p.cmdline()[1:4] == ["-u", "-m", "gptlaunch.shim"]
               and p.environ().get("GPTLAUNCH_HOST_NODE") == str(names.index(holder))]  # fmt: skip
    rank.kill()
    final = wait_terminal(SshScheduler(), JobRecord(jobs / job), 300, poll_s=0.5)
    assert final is not None and final.state == "succeeded", final
    (first,) = final.attempts
    assert first.replaced == {holder: "gl-h3"} and "killed by SIGKILL" in first.cause, first
    logs = "".join(p.read_text(errors="replace") for p in (jobs / job).glob("node-*.log"))  # attempt 2's
    resumed = [int(s) for s in re.findall(r"resumed from \S+/ckpt\.pt at step (\d+)", logs)]
    assert resumed and resumed[0] >= 100 and "step 2000/2000" in logs, logs[-3000:]
    assert (on_host("gl-h3", Path(run_dir)) / "ckpt.pt").is_file()  # the spare got the copy
    wait_for(lambda: not processes_of(job), 60, "every process of the job to end")


@contextlib.contextmanager
def without_program(host: str, path: str, tmp_path: Path) -> Iterator[None]:
    """``path`` (a program) gone from ``host`` alone: a plain file bind-mounted over it in the host's
    own mount namespace (its sshd's; ``dev-hosts.sh`` makes it private), so that no shell there finds
    it, while this machine and the other hosts keep theirs."""
    pid = (SSH_STATE / "hosts" / host / "sshd.pid").read_text().strip()
    blank = tmp_path / "not-a-program"
    blank.write_text("")
    nsenter = ["nsenter", "-t", pid, "-m"]
    run([*nsenter, "mount", "--bind", str(blank), path], check=True)
    try:
        yield
    finally:
        run([*nsenter, "umount", path], check=True)


def test_without_rsync_here_or_on_one_host_a_sync_job_is_refused_before_any_rank_starts(
    hostfile: Path, wikitext_valid: Path, private: Path, tmp_path: Path
) -> None:
    """``--sync`` copies with rsync, which runs on both ends: missing on this machine is exit 2, missing
    on one host exit 3 naming that host, each with the package to install, and nothing is started
    or written. This machine "without rsync" is a PATH of every program here but rsync."""
    hosts, project = first_hosts(hostfile, 2, tmp_path), plain_project(tmp_path, wikitext_valid)
    first, second = host_names(hosts)
    rsync = shutil.which("rsync")
    assert rsync is not None, "the set-up installs rsync (.ci/run)"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        for program in Path(directory).glob("*") if Path(directory).is_dir() else []:
            if program.name != "rsync" and not (bin_dir / program.name).exists():
                (bin_dir / program.name).symlink_to(program)
    workdir, jobs = private / "work", private / "jobs"
    argv = ["submit", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2", "--sync", str(project),
            "--workdir", str(workdir), "--", *PLAIN_ARGS]  # fmt: skip
    here = launcher(jobs, *argv, env={"PATH": str(bin_dir)})
    assert here.returncode == 2, here.stderr[-3000:]
    assert "--sync needs rsync" in here.stderr and "not installed on this machine" in here.stderr
    assert "apt-get install rsync" in here.stderr and "Traceback" not in here.stderr
    with without_program(second, rsync, tmp_path):
        host = launcher(jobs, *argv)
    assert host.returncode == 3, host.stderr[-3000:]
    assert "--sync needs rsync" in host.stderr and f"not installed on {second}:" in host.stderr
    assert first not in host.stderr.split("--sync needs rsync")[1] and "apt-get install rsync" in host.stderr
    assert not jobs.exists() or not any(jobs.iterdir()), "nothing may be written for a refused launch"
    assert not any(on_host(h, workdir).exists() for h in (first, second)), "nothing synced either"
