"""The pinned image on every scheduler, against the real things: the CPU image built with `launcher build`
and pushed to the dev registry (`deploy/docker/dev-registry.sh`: Debian's docker-registry over TLS), pulled
by digest with podman on the SSH test hosts (each into its own storage on its own disk) and on the dev
SLURM nodes, where each node's torchrun runs in a container its agent supervises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gptlaunch.contract import read_beats
from launcher.job.record import JobRecord
from tests.integration.conftest import (
    FAST,
    PLAIN_ARGS,
    first_hosts,
    launcher,
    logged_step,
    losses,
    metrics,
    missing_component,
    only_job_id,
    plain_project,
    processes_of,
    run,
    wait_for,
)

pytestmark = pytest.mark.beside  # see conftest.pytest_collection_modifyitems
# gl-h6 and gl-h7: the SSH tests that run beside these (make test) take gl-h1..3's links down
IMAGE_HOSTS_AFTER = 5

ROOT = Path(__file__).resolve().parents[2]
REGISTRY_SCRIPT = ROOT / "deploy" / "docker" / "dev-registry.sh"
SLURM_STATE = Path("/var/lib/gptlaunch-slurm")  # deploy/slurm/dev-cluster.sh: storage-nK.conf per node


@pytest.fixture(scope="session")
def registry(hostfile: Path) -> str:
    """``HOST:PORT`` of the dev registry, on the SSH hosts' bridge (so after the hosts are up)."""
    proc = run(["bash", str(REGISTRY_SCRIPT), "up"], timeout=300)
    if proc.returncode != 0:
        missing_component(f"dev-registry.sh up failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def pushed(
    engine: dict[str, str], ca_bundle: Path, registry: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The record of the CPU image built and pushed with `launcher build --push` (its tag, its digest)."""
    work = tmp_path_factory.mktemp("push")
    record = work / "record.json"
    proc = launcher(
        work, "build", "--variant", "cpu", "--base-image", engine["BASE_IMAGE"],
        "--tag", f"{registry}/gptlaunch-test:cpu", "--ca-bundle", str(ca_bundle), "--record", str(record),
        "--push", env={"DOCKER_HOST": engine["DOCKER_HOST"]}, timeout=2400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = dict(json.loads(record.read_text()))
    (digest,) = data["repo_digests"]
    assert digest.startswith(f"{registry}/gptlaunch-test@sha256:")
    return data


def ssh(host: str, command: str, check: bool = True) -> str:
    return run(["ssh", host, command], check=check, timeout=300).stdout


def containers(host: str) -> list[str]:
    """The containers in ``host``'s podman storage (running or not)."""
    return ssh(host, "podman ps --all --format '{{.Names}}'").split()


def slurm_containers(node: str) -> list[str]:
    conf = {"CONTAINERS_CONF": str(SLURM_STATE / "containers.conf")}
    env = os.environ | conf | {"CONTAINERS_STORAGE_CONF": str(SLURM_STATE / f"storage-{node}.conf")}
    argv = ["podman", "ps", "--all", "--format", "{{.Names}}"]
    return subprocess.run(
        argv, env=env, text=True, capture_output=True, check=True, timeout=120
    ).stdout.split()


def ssh_job(hosts: Path, image: str, args: list[str]) -> list[str]:
    flags = ["--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2", "--python", sys.executable]
    return [*flags, "--image", image, "--", *args]


def train(prepared_data: list[str], run_dir: Path, steps: int) -> list[str]:
    return [*FAST, *prepared_data, "--preset", "tiny", "--max-steps", str(steps), "--run-dir", str(run_dir)]


def test_two_hosts_pull_the_pinned_image_and_train_in_it_whatever_their_local_tag_holds(
    hostfile: Path,
    engine: dict[str, str],
    pushed: dict[str, Any],
    prepared_data: list[str],
    private: Path,
    tmp_path: Path,
) -> None:
    tag, digest = pushed["image"], pushed["repo_digests"][0]
    hosts = first_hosts(hostfile, 2, tmp_path, skip=IMAGE_HOSTS_AFTER)
    names = [line.split()[0] for line in hosts.read_text().splitlines()]
    for host in names:  # each host really pulls, into its own storage
        ssh(host, "podman rmi --all --force", check=False)
    # The second host's local image under the job's tag is another one: it must not run.
    ssh(names[1], f"tar -c -T /dev/null | podman import --quiet - {tag}")
    jobs, run_dir = private / "jobs", private / "run"  # share-nothing: the run dir comes back as a copy
    proc = launcher(jobs, "submit", *ssh_job(hosts, tag, train(prepared_data, run_dir, 20)),
                    env={"DOCKER_HOST": engine["DOCKER_HOST"]}, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"image {tag} is {digest}" in proc.stderr  # the tag resolved once, at submit
    plan = json.loads((jobs / only_job_id(jobs) / "plan.json").read_text())
    assert plan["facts"]["image"] == digest and set(plan["facts"]["runtimes"].values()) == {"podman"}
    for host in names:
        assert f"launcher: {host}: image pulled in " in proc.stderr
        assert f"launcher: {host}: probed in the image: image_digest={digest} " in proc.stderr
        assert ssh(host, f"podman image exists {digest} && echo yes").strip() == "yes"
        assert containers(host) == []  # nothing of the job is left
    assert {m["world_size"] for m in metrics(run_dir) if "world_size" in m} == {2}
    assert max(losses(run_dir)) == 20
    assert processes_of(only_job_id(jobs)) == []


def test_the_plain_script_runs_in_the_pinned_image_on_two_hosts_that_share_no_files(
    hostfile: Path,
    engine: dict[str, str],
    pushed: dict[str, Any],
    wikitext_valid: Path,
    private: Path,
    tmp_path: Path,
) -> None:
    """A user's program with ``--image`` on SSH: synced to each host's own disk, run in the image
    through the shim; its checkpoint (``--out {{run_dir}}``) comes back as the launcher's copy and its
    steps as beats."""
    hosts, project = (
        first_hosts(hostfile, 2, tmp_path, skip=IMAGE_HOSTS_AFTER),
        plain_project(tmp_path, wikitext_valid),
    )
    jobs = private / "jobs"
    plain = ["ddp_plain.py", "--data", "input.txt", "--steps", "30", "--out", "{{run_dir}}"]
    proc = launcher(jobs, "submit", "--sync", str(project), "--workdir", str(private / "work"),
                    *ssh_job(hosts, pushed["repo_digests"][0], plain), timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step 30/30" in proc.stdout
    job = only_job_id(jobs)
    assert (Path(JobRecord(jobs / job).plan().run_dir) / "ckpt.pt").is_file()  # the launcher's copy
    beats = [b for k in (0, 1) for b in read_beats(jobs / job / "heartbeat" / f"node-{k}")]
    assert sorted(b.step for b in beats) == [30, 30]
    names = [line.split()[0] for line in hosts.read_text().splitlines()]
    assert all(containers(h) == [] for h in names) and processes_of(job) == []


def test_a_host_that_cannot_reach_the_registry_is_named_before_any_rank_starts(
    hostfile: Path, engine: dict[str, str], pushed: dict[str, Any], registry: str, tmp_path: Path
) -> None:
    hosts = first_hosts(hostfile, 2, tmp_path, skip=IMAGE_HOSTS_AFTER)
    names = [line.split()[0] for line in hosts.read_text().splitlines()]
    digest = pushed["repo_digests"][0]
    ssh(names[1], f"podman rmi --force {digest}", check=False)  # it must pull
    address, port = registry.rsplit(":", 1)
    rule = [
        "OUTPUT",
        "-p",
        "tcp",
        "-d",
        address,
        "--dport",
        port,
        "-j",
        "REJECT",
        "--reject-with",
        "tcp-reset",
    ]
    netns = ["ip", "netns", "exec", names[1], "iptables"]
    run([*netns, "-I", *rule], check=True)
    try:
        jobs = tmp_path / "jobs"
        proc = launcher(jobs, "submit", *ssh_job(hosts, digest, ["--max-steps", "5"]), timeout=600)
    finally:
        run([*netns, "-D", *rule], check=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "cannot pull the image" in proc.stderr and f"{names[1]}: podman pull {digest}" in proc.stderr
    assert "connection refused" in proc.stderr  # the registry's (the network's) own error
    assert f"{names[0]}:" not in proc.stderr.split("cannot pull the image")[1]  # only the bad host is named
    assert not jobs.exists()  # refused before anything was written or started


def test_killing_one_hosts_container_fails_the_job_naming_that_host_and_leaves_nothing(
    hostfile: Path,
    engine: dict[str, str],
    pushed: dict[str, Any],
    prepared_data: list[str],
    private: Path,
    tmp_path: Path,
) -> None:
    hosts = first_hosts(hostfile, 2, tmp_path, skip=IMAGE_HOSTS_AFTER)
    names = [line.split()[0] for line in hosts.read_text().splitlines()]
    jobs, run_dir = private / "jobs", private / "run"
    flags = ssh_job(hosts, pushed["repo_digests"][0], train(prepared_data, run_dir, 100_000))
    proc = launcher(jobs, "submit", "--detach", *flags, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = proc.stdout.split()[0]
    try:
        wait_for(lambda: logged_step(jobs / job_id) >= 3, 300, "training to reach step 3")
        ssh(names[1], f"podman kill gptlaunch-{job_id}-node1")
        ended = launcher(jobs, "wait", job_id, timeout=300)
        assert ended.returncode not in (0, 75), ended.stderr[-3000:]
    finally:  # a failed assertion must not leave the job training
        launcher(jobs, "cancel", job_id, timeout=300)
    status = json.loads((jobs / job_id / "status.json").read_text())
    assert status["state"] == "failed" and names[1] in status["message"] and "node 1" in status["message"]
    wait_for(lambda: all(containers(h) == [] for h in names), 60, "no container left on either host")
    assert processes_of(job_id) == []


@pytest.mark.parametrize("way", ["submitit", "sbatch"])
def test_slurm_nodes_run_the_pinned_image_with_podman(
    way: str, engine: dict[str, str], pushed: dict[str, Any], prepared_data: list[str], tmp_path: Path
) -> None:
    if run(["sinfo", "--noheader"], timeout=60).returncode != 0:
        missing_component("the dev SLURM cluster is not up (deploy/slurm/dev-cluster.sh up --nodes 3)")
    tag, digest = pushed["image"], pushed["repo_digests"][0]
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    flags = [
        "--scheduler",
        "slurm",
        "--nodes",
        "2",
        "--no-slurm-gpus",
        "--time",
        "15",
        "--python",
        sys.executable,
    ]
    flags += ["--image", tag, "--container-runtime", "podman", "--"]
    args = [*prepared_data, *FAST, "--preset", "tiny", "--max-steps", "20", "--run-dir", str(run_dir)]
    env = {"DOCKER_HOST": engine["DOCKER_HOST"]}
    if way == "submitit":
        proc = launcher(jobs, "submit", "--wait", *flags, *args, env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        job_dir = jobs / only_job_id(jobs)
    else:
        script = launcher(jobs, "render", *flags, *args, env=env, check=True).stdout
        assert f"# The nodes run the image {digest} with podman: " in script, script[:800]
        (tmp_path / "job.sbatch").write_text(script)
        out = run(["sbatch", "--parsable", "--wait", str(tmp_path / "job.sbatch")], cwd=tmp_path, timeout=900)
        assert out.returncode == 0, (tmp_path / f"slurm-{out.stdout.strip()}.out").read_text()[-3000:]
        (job_dir,) = jobs.iterdir()
    reports = [json.loads(p.read_text()) for p in sorted((job_dir / "parity").glob("node-*.json"))]
    assert [r["image_digest"] for r in reports] == [digest, digest]  # probed inside the image on both
    assert {m["world_size"] for m in metrics(run_dir) if "world_size" in m} == {2}
    assert max(losses(run_dir)) == 20
    for node in ("n1", "n2", "n3"):
        assert slurm_containers(node) == []


def test_the_plain_script_runs_in_the_pinned_image_on_slurm_nodes(
    engine: dict[str, str], pushed: dict[str, Any], wikitext_valid: Path, tmp_path: Path
) -> None:
    """A user's program with ``--image`` on SLURM (submitit, podman): the shim runs it in the image on
    both nodes; its checkpoint lands in the shared workdir and its steps come back as beats."""
    if run(["sinfo", "--noheader"], timeout=60).returncode != 0:
        missing_component("the dev SLURM cluster is not up (deploy/slurm/dev-cluster.sh up --nodes 3)")
    jobs, project = tmp_path / "jobs", plain_project(tmp_path, wikitext_valid)
    flags = ["--scheduler", "slurm", "--nodes", "2", "--no-slurm-gpus", "--time", "15", "--python",
             sys.executable, "--image", pushed["image"], "--container-runtime", "podman"]  # fmt: skip
    proc = launcher(jobs, "submit", "--wait", *flags, "--workdir", str(project), "--", *PLAIN_ARGS,
                    env={"DOCKER_HOST": engine["DOCKER_HOST"]}, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    job_dir = jobs / only_job_id(jobs)
    assert "step 30/30" in "".join(log.read_text() for log in job_dir.glob("node-*.log"))
    assert (project / "out" / "ckpt.pt").is_file()
    beats = [b for k in (0, 1) for b in read_beats(job_dir / "heartbeat" / f"node-{k}")]
    assert sorted((b.rank, b.step) for b in beats) == [(0, 30), (1, 30)]
    digests = {json.loads(p.read_text())["image_digest"] for p in (job_dir / "parity").glob("node-*.json")}
    assert digests == {pushed["repo_digests"][0]}
    for node in ("n1", "n2", "n3"):
        assert slurm_containers(node) == []
