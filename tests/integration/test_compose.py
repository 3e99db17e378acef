"""The compose scheduler against a real Docker engine (`deploy/docker/dev-engine.sh`) and the CPU image
built by `launcher build`: two containers train together over their own network, the checkpoint lands
on the host, a killed container ends the job everywhere, Ctrl-C and cancel stop it, and nothing of the
job (containers, network) is left. Under CI=true a missing engine fails these tests instead of skipping
them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from launcher.job.progress import recorded_beats
from launcher.job.record import JobRecord
from launcher.report.page import PARITY_MISSING
from tests.integration.browser import dump_dom, traces
from tests.integration.conftest import (
    FAST,
    PLAIN_ARGS,
    TAG,
    docker,
    launcher,
    metrics,
    only_job_id,
    plain_project,
    processes_of,
    wait_for,
)

pytestmark = pytest.mark.beside  # see conftest.pytest_collection_modifyitems

SECRET = "hf_compose_canary_40d2a7"


TWO = ["--nodes", "2", "--gpus-per-node", "1"]


def submit_args(prepared_data: list[str], run_dir: Path, steps: int, *flags: str) -> list[str]:
    """`launcher submit` of a 2-node compose job training ``steps`` steps (``flags``: more launcher flags)."""
    return [
        "submit", "--scheduler", "compose", "--image", TAG, "--nodes", "2", "--gpus-per-node", "1", *flags,
        "--",
        *FAST, *prepared_data, "--preset", "tiny", "--max-steps", str(steps), "--run-dir", str(run_dir),
    ]  # fmt: skip


def launcher_argv(jobs: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), *args]


def left_of(engine: dict[str, str], job: str) -> tuple[str, str]:
    """The job's containers and networks that still exist (sorted names, one per line)."""
    label = f"label=io.gptlaunch.job={job}"
    containers = docker(engine, "ps", "--all", "--filter", label, "--format", "{{.Names}}")
    networks = docker(engine, "network", "ls", "--filter", label, "--format", "{{.Name}}")
    return "\n".join(sorted(containers.split())), "\n".join(sorted(networks.split()))


def training_started(jobs: Path, run_dir: Path) -> bool:
    """True once the ranks log metrics; fails the test at once if the job ended before that."""
    for status in jobs.glob("*/status.json"):
        ended = json.loads(status.read_text())
        assert ended["state"] in ("created", "pending", "running"), ended.get("message")
    return (run_dir / "metrics.jsonl").is_file()


def submit_detached(jobs: Path, run_dir: Path, prepared_data: list[str], env: dict[str, str]) -> str:
    """Submit a long compose job with --detach; return its id once its ranks train."""
    proc = launcher(jobs, *submit_args(prepared_data, run_dir, 100000, "--detach"), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wait_for(lambda: training_started(jobs, run_dir), 600, "training to start")
    return proc.stdout.strip()


@contextlib.contextmanager
def attached(
    engine: dict[str, str], jobs: Path, run_dir: Path, prepared_data: list[str]
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """An attached `launcher submit` of a long compose job (HF_TOKEN set, stderr piped) and its job id,
    once its ranks train; killed on the way out if it still runs."""
    env = os.environ | {"DOCKER_HOST": engine["DOCKER_HOST"], "HF_TOKEN": SECRET}
    argv = launcher_argv(jobs, submit_args(prepared_data, run_dir, 100000))
    submit = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for(lambda: training_started(jobs, run_dir), 600, "training to start")
        yield submit, only_job_id(jobs)
    finally:
        if submit.poll() is None:
            submit.kill()


def test_two_containers_train_and_leave_nothing(
    engine: dict[str, str], cpu_image: dict[str, Any], prepared_data: list[str], tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    argv = launcher_argv(jobs, [*submit_args(prepared_data, run_dir, 20), "--checkpoint-interval", "10"])
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=1200,
        env=os.environ | {"DOCKER_HOST": engine["DOCKER_HOST"], "HF_TOKEN": SECRET},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [m for m in metrics(run_dir) if "tokens_per_s" in m]
    assert rows[-1]["step"] == 20 and {m["world_size"] for m in rows} == {2}
    assert list(run_dir.glob("ckpt-*.pt")), "the checkpoint lands in the run dir on the host"
    job = only_job_id(jobs)
    assert left_of(engine, job) == ("", ""), "containers and network are removed"
    assert "node0 | " in proc.stdout and "node1 | " in proc.stdout
    for k in range(2):  # the secret went in through the attach's stdin, to torchrun only
        log = (jobs / job / f"node-{k}.log").read_text()
        assert "version parity: the 2 nodes match" in log and "secrets given to torchrun: HF_TOKEN" in log
    compose = (jobs / job / "compose.yaml").read_text()
    assert cpu_image["id"] in compose and "GLOO_SOCKET_IFNAME: eth0" in compose
    written = "".join(p.read_text(errors="replace") for p in (jobs / job).rglob("*") if p.is_file())
    assert SECRET not in written + proc.stdout + proc.stderr


def test_the_plain_script_trains_in_two_containers(
    engine: dict[str, str], cpu_image: dict[str, Any], wikitext_valid: Path, tmp_path: Path
) -> None:
    jobs, project = tmp_path / "jobs", plain_project(tmp_path, wikitext_valid)
    args = ["submit", "--scheduler", "compose", "--image", TAG, *TWO, "--workdir", str(project)]
    proc = subprocess.run(
        launcher_argv(jobs, [*args, "--", *PLAIN_ARGS]), capture_output=True, text=True, timeout=1200,
        env=os.environ | {"DOCKER_HOST": engine["DOCKER_HOST"]},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step 30/30" in proc.stdout and (project / "out" / "ckpt.pt").is_file()
    job_dir = jobs / only_job_id(jobs)
    beats = recorded_beats(JobRecord(job_dir).plan(), job_dir)  # what `launcher status` reads
    assert sorted((b.rank, b.step) for node in beats.values() for b in node) == [(0, 30), (1, 30)]
    assert left_of(engine, job_dir.name) == ("", "")


def test_a_killed_container_ends_the_job_everywhere(
    engine: dict[str, str], cpu_image: dict[str, Any], prepared_data: list[str], tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    with attached(engine, jobs, run_dir, prepared_data) as (submit, job):
        names = [f"gptlaunch-{job}-node{k}" for k in range(2)]
        assert left_of(engine, job) == ("\n".join(names), f"gptlaunch-{job}_job")  # what must go
        inspected = docker(engine, "inspect", *names)
        assert SECRET not in inspected and "HF_TOKEN" not in inspected  # not in the containers' config
        docker(engine, "kill", names[1])
        _, err = submit.communicate(timeout=120)
    assert submit.returncode not in (0, None)
    assert "node 1" in err, err[-3000:]
    assert left_of(engine, job) == ("", "")
    status = json.loads((jobs / job / "status.json").read_text())
    assert status["state"] == "failed" and status["failure"]["node_rank"] == 1


def test_a_rank_killed_by_sigkill_is_the_cause_not_the_peer_that_saw_it_go(
    engine: dict[str, str], cpu_image: dict[str, Any], prepared_data: list[str], tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    with attached(engine, jobs, run_dir, prepared_data) as (submit, job):
        (rank1,) = [p for p in processes_of(job) if _is_rank(p.cmdline()) and p.environ().get("RANK") == "1"]
        node = _node_of(rank1)
        rank1.kill()  # the container's processes are this machine's
        _, err = submit.communicate(timeout=120)
    assert submit.returncode == 1, err[-3000:]
    assert f"node {node}, rank 1" in err and "killed by SIGKILL" in err, err[-3000:]
    failure = json.loads((jobs / job / "status.json").read_text())["failure"]
    assert (failure["node_rank"], failure["rank"]) == (node, 1) and "SIGKILL" in failure["error"], failure
    assert left_of(engine, job) == ("", "")


def _node_of(rank: psutil.Process) -> int:
    """The job's node (not torchrun's group rank, which is the order of joining) a rank runs on: its
    heartbeat directory is ``JOB/heartbeat/node-<k>``."""
    return int(rank.environ()["GPTLAUNCH_HEARTBEAT_DIR"].rsplit("-", 1)[1])


def _is_rank(cmdline: list[str]) -> bool:
    """A training process (torchrun's worker), not the torchrun agent that started it."""
    torchrun = {"torch.distributed.run", "launcher.agent.torchrun"}  # as rendered, as the agent runs it
    return "trainer.cli" in cmdline and not torchrun & set(cmdline)


def test_a_detached_job_is_followed_and_cancelled_like_any_other(
    engine: dict[str, str], cpu_image: dict[str, Any], prepared_data: list[str], tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    env = {"DOCKER_HOST": engine["DOCKER_HOST"]}
    job = submit_detached(jobs, run_dir, prepared_data, env)
    assert all(left_of(engine, job)), "the containers and the network exist while it runs"
    # status and cancel from a shell whose DOCKER_HOST is elsewhere: the job's engine is in its record
    env = {"DOCKER_HOST": f"unix://{tmp_path}/elsewhere.sock"}
    status = json.loads(launcher(jobs, "status", job, "--json", env=env, check=True).stdout)
    assert status["state"] == "running"
    cancel = launcher(jobs, "cancel", job, env=env)
    assert cancel.returncode == 0, cancel.stderr[-2000:]
    final = json.loads(launcher(jobs, "status", job, "--json", env=env, check=True).stdout)
    assert final["state"] in ("checkpointed", "cancelled") and final["state"] != "running"
    if final["state"] == "checkpointed":  # the ranks saved a checkpoint on the host before exiting
        assert list(run_dir.glob("ckpt-*.pt"))
    logs = launcher(jobs, "logs", job, env=env, check=True).stdout
    assert "node0 | " in logs and "node1 | " in logs
    assert left_of(engine, job) == ("", "")


def test_a_job_whose_supervisor_died_is_ended_and_leaves_nothing(
    engine: dict[str, str], cpu_image: dict[str, Any], prepared_data: list[str], tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    env = {"DOCKER_HOST": engine["DOCKER_HOST"]}
    job = submit_detached(jobs, run_dir, prepared_data, env)
    supervisor = json.loads((jobs / job / "handle.json").read_text())["supervisor"]["pid"]
    os.kill(supervisor, signal.SIGKILL)  # the agents get SIGTERM from the kernel, the containers stop
    # status from a shell whose DOCKER_HOST is elsewhere: it finds the containers on the job's engine
    env = {"DOCKER_HOST": f"unix://{tmp_path}/elsewhere.sock"}

    seen: list[str] = []

    def ended() -> bool:
        status = json.loads(launcher(jobs, "status", job, "--json", env=env, check=True).stdout)
        seen[:] = [status.get("message") or status["state"]]
        return status["state"] not in ("created", "pending", "running")

    try:
        wait_for(ended, 300, "status to find the job's end")
    except AssertionError as e:  # what was still running, or what could not be checked
        raise AssertionError(f"{e}; status said last: {seen}") from None
    final = json.loads((jobs / job / "status.json").read_text())
    assert final["state"] in ("checkpointed", "lost"), final
    assert left_of(engine, job) == ("", ""), "status removed the stopped containers and the network"


def test_ctrl_c_stops_an_attached_job_and_leaves_nothing(
    engine: dict[str, str], cpu_image: dict[str, Any], prepared_data: list[str], tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    with attached(engine, jobs, run_dir, prepared_data) as (submit, job):
        # what the engine mounted, not what was rendered: the text read-only, the run dir read-write
        inspected = docker(engine, "inspect", "--format", "{{json .Mounts}}", f"gptlaunch-{job}-node1")
        writable = {m["Destination"]: m["RW"] for m in json.loads(inspected)}
        assert writable[prepared_data[1]] is False and writable[str(run_dir)] is True, writable
        submit.send_signal(signal.SIGINT)
        _, err = submit.communicate(timeout=300)
    status = json.loads((jobs / job / "status.json").read_text())
    assert status["state"] in ("checkpointed", "cancelled"), err[-3000:]
    assert submit.returncode == status["exit_code"] != 0
    assert left_of(engine, job) == ("", ""), "Ctrl-C removed the containers and the network"
    assert SECRET not in docker(engine, "history", "--no-trunc", TAG) + docker(engine, "inspect", TAG)


def test_a_missing_image_or_engine_is_refused_and_writes_nothing(
    engine: dict[str, str], tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs"
    submit = ["submit", "--scheduler", "compose", "--image", "gptlaunch-test/no-such-image:1", "--nodes", "2"]
    proc = launcher(jobs, *submit, "--", "--max-steps", "1", env={"DOCKER_HOST": engine["DOCKER_HOST"]})
    assert proc.returncode == 2 and "is not in the engine" in proc.stderr, proc.stderr[-2000:]
    proc = launcher(
        jobs, *submit, "--", "--max-steps", "1", env={"DOCKER_HOST": f"unix://{tmp_path}/none.sock"}
    )
    assert proc.returncode == 2 and "cannot reach the Docker engine" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not jobs.exists() or not any(jobs.iterdir())


def test_a_stopped_rank_is_a_hang_named_by_the_container_entry(
    engine: dict[str, str], cpu_image: dict[str, Any], prepared_data: list[str], tmp_path: Path
) -> None:
    """Each container's entry watches its ranks' heartbeats; the job ends as a hang naming the stopped
    rank, with every rank's stack (dumped inside its container) in the job record."""
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    env = os.environ | {"DOCKER_HOST": engine["DOCKER_HOST"]}
    proc = launcher(
        jobs, *submit_args(prepared_data, run_dir, 100000, "--detach", "--hang-timeout-s", "10"), env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = proc.stdout.strip()
    wait_for(
        lambda: (
            training_started(jobs, run_dir) and max((m["step"] for m in metrics(run_dir)), default=0) >= 3
        ),
        600,
        "step 3",
    )
    (rank1,) = [p for p in processes_of(job) if _is_rank(p.cmdline()) and p.environ().get("RANK") == "1"]
    os.kill(rank1.pid, signal.SIGSTOP)

    seen: list[dict[str, Any]] = []

    def ended() -> bool:
        seen.append(json.loads(launcher(jobs, "status", job, "--json", env=env, check=True).stdout))
        return seen[-1]["state"] not in ("created", "pending", "running")

    try:
        wait_for(ended, 150, "the job to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1.pid, signal.SIGCONT)
    status = seen[-1]
    assert status["state"] == "failed", status
    assert "rank 1 (node " in status["message"] and "is stopped (SIGSTOP?)" in status["message"], status
    stacks = [p.read_text() for p in (jobs / job / "hang").iterdir()]  # dumped inside each container
    assert len(stacks) == 2 and all("Python v" in text for text in stacks), stacks
    wait_for(lambda: left_of(engine, job) == ("", ""), 60, "the containers and network to go")
    print(f"\n{status['message']}")


def test_a_killed_rank_is_retried_in_new_containers(
    engine: dict[str, str], cpu_image: dict[str, Any], prepared_data: list[str], tmp_path: Path
) -> None:
    """--retries 1: the containers are made anew for attempt 2, which resumes from the checkpoint."""
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    env = os.environ | {"DOCKER_HOST": engine["DOCKER_HOST"]}
    flags = ["--detach", "--retries", "1", "--retry-backoff-s", "1"]
    proc = launcher(
        jobs, *submit_args(prepared_data, run_dir, 30, *flags), "--checkpoint-interval", "10", env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = proc.stdout.strip()
    wait_for(
        lambda: (
            training_started(jobs, run_dir) and max((m["step"] for m in metrics(run_dir)), default=0) >= 12
        ),
        600,
        "step 12",
    )
    (rank1,) = [p for p in processes_of(job) if _is_rank(p.cmdline()) and p.environ().get("RANK") == "1"]
    rank1.kill()
    final: dict[str, Any] = {}

    def ended() -> bool:
        final.update(json.loads(launcher(jobs, "status", job, "--json", env=env, check=True).stdout))
        return final["state"] not in ("created", "pending", "running")

    wait_for(ended, 600, "the job to end")
    assert final["state"] == "succeeded" and final["attempt"] == 2, final
    assert "killed by SIGKILL" in final["attempts"][0]["cause"], final
    assert [m["step"] for m in metrics(run_dir) if "tokens_per_s" in m] == list(range(1, 31))
    assert left_of(engine, job) == ("", "")
    # The report of a compose job, in a real browser: both attempts drawn, with the cause, and the
    # containers' parity step in words, not the sentence said of a job that ran none.
    page = Path(launcher(jobs, "report", job, env=env, check=True).stdout.strip())
    dom = dump_dom(page, tmp_path)
    assert traces(dom, "attempts") >= 2 and traces(dom, "loss") >= 1, dom[-3000:]
    assert "attempt 1: failed at step " in dom and "<li>attempt 2: succeeded; first step " in dom, dom[-3000:]
    assert "killed by SIGKILL" in dom and PARITY_MISSING not in dom, dom[-3000:]
