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
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest

from gptlaunch.contract import read_beats
from tests.integration.conftest import (
    FAST,
    PLAIN_ARGS,
    SSH_STATE,
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
    runs_module,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
CANARY = "hf_canary_3f9d1e"


def host_names(hostfile: Path) -> list[str]:
    return [line.split()[0] for line in hostfile.read_text().splitlines() if line and line[0] != "#"]


def train_args(prepared_data: list[str], run_dir: Path, steps: int) -> list[str]:
    return [*FAST, *prepared_data, "--preset", "tiny", "--max-steps", str(steps), "--run-dir", str(run_dir)]


def step_of(jobs: Path) -> int:
    """The furthest step logged by the one job in ``jobs`` (0 before it exists)."""
    found = list(jobs.iterdir()) if jobs.is_dir() else []
    return logged_step(found[0]) if found else 0


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
        ranks = [p for p in processes_of(job) if runs_module(p, "trainer.cli")]
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
