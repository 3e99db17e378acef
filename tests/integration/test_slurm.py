"""The SLURM scheduler against a real SLURM cluster on this machine (deploy/slurm/dev-cluster.sh): munge,
slurmctld, slurmdbd with MariaDB, three slurmd (the jobs use two; the retry test moves off one). Under
CI=true a missing cluster fails these tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import time
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest

from gptlaunch.contract import read_beats
from tests.integration.conftest import (
    FAST,
    PLAIN_ARGS,
    launcher,
    losses,
    make_other_venv,
    metrics,
    only_job_id,
    plain_project,
    processes_of,
    run,
    slowed,
)
from tests.integration.slurm_helpers import (
    SLURM_2x1,
    files_containing,
    hostnames,
    is_rank,
    node_of,
    reached,
    sacct,
    sbatch_rendered,
    slurm_cluster,  # noqa: F401 (autouse: the dev cluster is up)
    slurm_id_of,
    slurm_queue_left_empty,  # noqa: F401 (autouse: no job left queued after a test)
    status_json,
    trainer_args,
    until,
    until_ended,
    untouched,
)

pytestmark = pytest.mark.beside  # see conftest.pytest_collection_modifyitems


@pytest.mark.parametrize("path", ["submitit", "sbatch script"])
def test_the_plain_script_trains_on_two_nodes(path: str, wikitext_valid: Path, tmp_path: Path) -> None:
    jobs, project = tmp_path / "jobs", plain_project(tmp_path, wikitext_valid)
    if path == "submitit":
        proc = launcher(jobs, "submit", *SLURM_2x1, "--workdir", str(project), "--wait", "--", *PLAIN_ARGS)
        assert proc.returncode == 0, proc.stderr[-4000:]
        # live, node-prefixed output: rank 0's lines, on node 0 and its host
        assert re.search(r"^n\d node0 \| \[rank0\]: step 30/30", proc.stdout, re.MULTILINE), proc.stdout
    else:
        slurm_id = sbatch_rendered(jobs, tmp_path, PLAIN_ARGS, "--workdir", str(project))
        until_ended(slurm_id)
        assert sacct(slurm_id, "State,ExitCode") == [["COMPLETED", "0:0"]]
    (job_dir,) = jobs.iterdir()
    logs = "".join(log.read_text() for log in job_dir.glob("node-*.log"))
    assert "step 30/30" in logs and (project / "out" / "ckpt.pt").is_file()
    beats = [b for k in (0, 1) for b in read_beats(job_dir / "heartbeat" / f"node-{k}")]  # what status reads
    assert sorted((b.rank, b.step) for b in beats) == [(0, 30), (1, 30)]


def test_the_sbatch_scripts_controller_names_a_stopped_rank_and_retries_on_the_spare(
    prepared_data, tmp_path: Path
) -> None:
    """The plain sbatch script (``--spare-nodes 1 --retries 1``), submitted with sbatch alone, runs the
    job's controller: rank 1 is stopped (SIGSTOP); the controller gathers the nodes' hang reports,
    writes every rank's stacks and the cause into the job record the script wrote, and retries on
    the spare within the same allocation (one run in ``sacct``), to the job's end."""
    jobs, run_dir, steps = tmp_path / "jobs", tmp_path / "run", 30
    args = trainer_args(prepared_data, run_dir, steps)
    flags = ["--hang-timeout-s", "10", "--spare-nodes", "1", "--retries", "1"]
    slurm_id = sbatch_rendered(jobs, tmp_path, args, *flags)
    until("step 3", lambda: reached(run_dir, 3), timeout=300)
    (job_dir,) = jobs.iterdir()
    ranks = [p for p in processes_of(job_dir.name) if is_rank(p.cmdline())]
    (rank1,) = [p for p in ranks if p.environ().get("RANK") == "1"]
    stopped, ran = rank1.environ()["SLURMD_NODENAME"], {p.environ()["SLURMD_NODENAME"] for p in ranks}
    rank1.suspend()  # SIGSTOP
    try:
        until_ended(slurm_id, timeout=300)
    finally:
        with contextlib.suppress(psutil.Error):
            rank1.resume()
    assert sacct(slurm_id, "State,ExitCode", duplicates=True) == [["COMPLETED", "0:0"]]  # no requeue
    status = json.loads((job_dir / "status.json").read_text())  # as the controller left it
    assert status["state"] == "succeeded", status
    (first,) = status["attempts"]
    assert first["cause"].startswith("hang: no progress for ") and ") is stopped (SIGSTOP?)" in first["cause"]
    (spare,) = set(hostnames("ALL")) - ran
    assert first["replaced"] == {stopped: spare}, first
    stacks = sorted(p.name.split("-")[1] for p in job_dir.glob("**/hang/*.txt"))
    assert stacks == ["rank0.txt", "rank1.txt"], stacks
    assert "watchdog: no progress for " in (job_dir / "attempts" / "1" / "node-0.log").read_text()
    assert "step 30/30" in "".join(p.read_text() for p in job_dir.glob("node-*.log"))
    until("no process of the job", lambda: not processes_of(job_dir.name), timeout=60)


def test_preemption_checkpoints_requeues_and_resumes_to_exactly_max_steps(
    prepared_data, tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    args = trainer_args(prepared_data, run_dir, 60)
    proc = launcher(jobs, "submit", *SLURM_2x1, "--", *args, check=True)
    job_id = proc.stdout.strip()
    slurm_id = slurm_id_of(jobs, job_id)
    until("step 5", lambda: reached(run_dir, 5))
    # What SLURM sends before a time limit or a preemption (--signal=USR2@90), to every process.
    run(["scancel", "--signal=USR2", "--full", slurm_id], check=True)
    stopped = until(
        "stop checkpoint",
        lambda: (
            json.loads((run_dir / "stopped.json").read_text())
            if (run_dir / "stopped.json").is_file()
            else None
        ),
    )
    assert stopped["signal"] == "SIGUSR2" and 5 <= stopped["step"] < 60
    waited = launcher(jobs, "wait", job_id, timeout=900)
    assert waited.returncode == 0, waited.stderr[-4000:]
    assert status_json(jobs, job_id)["state"] == "succeeded"
    # Requeued once (two runs under one job id), and the second resumed: no step trained twice.
    assert [r[0] for r in sacct(slurm_id, "State", duplicates=True)] == ["REQUEUED", "COMPLETED"]
    steps = sorted(losses(run_dir))
    assert steps == list(range(1, 61))
    log = "".join(p.read_text() for p in (jobs / job_id).glob("node-*.log"))  # rank 0 on either node
    assert "resum" in log.lower() and str(stopped["step"]) in log
    assert {m["world_size"] for m in metrics(run_dir) if "world_size" in m} == {2}
    assert list(run_dir.glob("*60*.pt"))
    for node in (0, 1):  # each node's output in the job record
        assert "rank" in (jobs / job_id / f"node-{node}.log").read_text()
    # What submit handed to sbatch (the file submitit wrote) is what render prints (--file submitit.sbatch).
    submitted = (jobs / job_id / "submitit" / f"{slurm_id}_submission.sh").read_text()
    assert submitted == json.loads((jobs / job_id / "plan.json").read_text())["files"]["submitit.sbatch"]


def test_cancel_ends_running_and_queued_jobs_and_secrets_stay_off_disk(prepared_data, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    canary = f"canary-{os.getpid()}-{time.time_ns()}"
    long_run = [*prepared_data, *FAST, "--max-steps", "100000"]
    env = {"HF_TOKEN": canary}
    first = launcher(
        jobs, "submit", *SLURM_2x1, "--", *long_run, "--run-dir", str(tmp_path / "a"), env=env, check=True
    )
    second = launcher(
        jobs, "submit", *SLURM_2x1, "--", *long_run, "--run-dir", str(tmp_path / "b"), check=True
    )
    running, queued = first.stdout.strip(), second.stdout.strip()
    # The cluster's two nodes have one CPU each: the second job waits for the first.
    until("first job running", lambda: status_json(jobs, running)["state"] == "running")
    assert status_json(jobs, queued)["state"] == "pending"
    until("step 2", lambda: reached(tmp_path / "a", 2))
    ranks = [p for p in processes_of(running) if is_rank(p.cmdline())]
    assert len(ranks) == 2 and all(p.environ().get("HF_TOKEN") == canary for p in ranks)  # the job gets it

    cancelled = launcher(jobs, "cancel", queued, check=True)
    assert "cancelled" in cancelled.stdout and status_json(jobs, queued)["state"] == "cancelled"
    launcher(jobs, "cancel", running, check=True)
    assert status_json(jobs, running)["state"] == "checkpointed"
    until("no process of the job", lambda: not processes_of(running), timeout=30)
    assert files_containing(jobs, canary) == []  # records, submitit folder, pickles, logs


def test_a_failing_rank_fails_the_job_naming_node_and_rank(prepared_data, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    args = [*prepared_data, *FAST, "--max-steps", "200", "--run-dir", str(tmp_path / "run")]
    proc = launcher(
        jobs, "submit", *SLURM_2x1, "--wait", "--", *args, env={"GPTLAUNCH_FAULT": "1:3"}, timeout=600
    )
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "injected fault on rank 1 at step 3" in proc.stderr
    job_id = proc.stdout.splitlines()[0]
    failure = status_json(jobs, job_id)["failure"]
    node = failure["node_rank"]  # rank 1 is node 1's (a static rendezvous), on the host it names
    assert (node, failure["rank"]) == (1, 1) and f"node 1 (host {failure['host']}), rank 1" in proc.stderr
    assert "rank 1/2 " in (jobs / job_id / f"node-{node}.log").read_text()
    until("no process of the job", lambda: not processes_of(job_id), timeout=30)


def test_without_a_spare_a_killed_rank_requeues_the_job_without_its_node_and_resumes_at_its_step(
    prepared_data, tmp_path: Path
) -> None:
    """``--retries 1``, no spare, no checkpoint interval before the end: rank 1 is SIGKILLed past step
    12. The cause is that rank, not the peer that saw it go; the survivor keeps the step the job
    reached in its host's memory; the controller requeues the job (one SLURM job id, two runs in
    ``sacct``) excluding the node it ran on; the second run resumes at that step and trains exactly
    ``--max-steps`` steps, each logged once."""
    jobs, run_dir, steps = tmp_path / "jobs", tmp_path / "run", 30
    argv = [*SLURM_2x1, "--retries", "1", "--", *trainer_args(prepared_data, run_dir, steps)]
    proc = launcher(jobs, "submit", *argv)
    assert proc.returncode == 0, proc.stderr[-4000:]
    job_id = proc.stdout.splitlines()[0]
    until("step 12", lambda: reached(run_dir, 12), timeout=300)  # past the first gather of RNG states
    (rank1,) = [p for p in processes_of(job_id) if is_rank(p.cmdline()) and p.environ().get("RANK") == "1"]
    node, host = node_of(rank1), rank1.environ()["SLURMD_NODENAME"]
    rank1.kill()
    terminal = ("succeeded", "failed", "cancelled", "checkpointed", "lost")
    status = until("the job ended", lambda: (s := status_json(jobs, job_id))["state"] in terminal and s, 400)
    assert status["state"] == "succeeded", status
    (first,) = status["attempts"]
    failure = first["failure"]
    assert (failure["node_rank"], failure["rank"]) == (node, 1), first
    assert "killed by SIGKILL" in failure["error"] and first["excluded"] == [host], first
    runs = sacct(slurm_id_of(jobs, job_id), "State,NodeList", duplicates=True)
    assert [r[0] for r in runs] == ["REQUEUED", "COMPLETED"], runs
    assert host not in hostnames(runs[1][1]), runs
    assert [m["step"] for m in metrics(run_dir) if "tokens_per_s" in m] == list(range(1, steps + 1))
    logs = "".join(p.read_text() for p in (jobs / job_id).glob("node-*.log"))
    resumed = re.search(r"resumed from the snapshot in \S+ memory at step (\d+)", logs)
    assert resumed is not None and int(resumed[1]) == first["step"], (first, logs[-3000:])
    until("no process of the job", lambda: not processes_of(job_id), timeout=60)


def test_a_node_with_other_versions_ends_the_job_before_training(prepared_data, tmp_path: Path) -> None:
    """The parity step: node 1 runs an interpreter whose tokenizers differs (chosen by SLURM_NODEID)."""
    other_python, other = make_other_venv(tmp_path)
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\n[ "$SLURM_NODEID" = 1 ] && exec {other_python} "$@"\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    args = [*prepared_data, *FAST, "--max-steps", "5", "--run-dir", str(run_dir)]
    proc = launcher(jobs, "submit", *SLURM_2x1, "--python", str(python), "--wait", "--", *args, timeout=600)
    assert proc.returncode == 3, proc.stderr[-4000:]
    line = next(x for x in proc.stderr.splitlines() if "packages.tokenizers:" in x)
    assert version("tokenizers") in line and other in line and "(node 0)" in line and "(node 1)" in line
    job_id = proc.stdout.splitlines()[0]
    assert status_json(jobs, job_id)["state"] == "failed" and status_json(jobs, job_id)["exit_code"] == 3
    assert sacct(slurm_id_of(jobs, job_id), "State,ExitCode") == [["FAILED", "3:0"]]
    assert untouched(run_dir), "no rank may start when the versions differ"
    assert not (jobs / job_id / "node-0.log").exists() and not (jobs / job_id / "node-1.log").exists()


def _slurmd(node: str) -> psutil.Process:
    """The dev cluster's ``slurmd -N node``, parent of every step's processes on that node."""
    (found,) = [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if p.info["name"] == "slurmd" and p.info["cmdline"][-2:] == ["-N", node]
    ]
    return found


def _idle_nodes() -> list[str]:
    return run(["sinfo", "--noheader", "--Node", "--states=idle", "--format=%N"], check=True).stdout.split()


@pytest.mark.alone  # busy loops on a core, or a 2 s step budget
def test_the_health_gate_ends_the_job_before_training_naming_a_slowed_node(
    prepared_data, tmp_path: Path
) -> None:
    """``--health-check`` on n1 and n2, n1's slurmd and every step it starts slowed (its core shared with
    busy loops): the gate's compute check names n1 and the job fails with exit 3 before any rank starts."""
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    args = [*prepared_data, *FAST, "--max-steps", "3", "--run-dir", str(run_dir)]
    flags = ["--health-check", "--slurm-opt", "nodelist=n1,n2", "--wait"]
    with slowed(_slurmd("n1")):
        proc = launcher(jobs, "submit", *SLURM_2x1, *flags, "--", *args, timeout=600)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    job_id = proc.stdout.splitlines()[0]
    status = status_json(jobs, job_id)
    assert (status["state"], status["exit_code"]) == ("failed", 3), status
    assert status["message"].startswith("the health gate named 1 node(s):\n  n1: compute "), status["message"]
    assert "n1: compute " in proc.stderr, proc.stderr[-3000:]
    assert untouched(run_dir), "no rank may start when the gate names a node"
    assert not (jobs / job_id / "node-0.log").exists() and not (jobs / job_id / "node-1.log").exists()
    # The report of the refused job: the gate's device table with n1 named, and the nodes' parity.
    page = Path(launcher(jobs, "report", job_id, check=True).stdout.strip()).read_text()
    devices = page.split("<table id='health-devices'>")[1].split("</table>")[0]
    assert "<tr class=named><td>n1</td>" in devices and "<tr><td>n2</td>" in devices, devices
    assert "<li>n1: compute " in page.split("<ul id='health-findings'>")[1].split("</ul>")[0]
    here = socket.gethostname()  # the dev cluster's nodes share this machine's name: told apart by rank
    assert f"2 host(s) {here} (node 0), {here} (node 1) alike" in page.split("<pre id='parity'>")[1]


@pytest.mark.alone  # busy loops on a core, or a 2 s step budget
def test_with_retries_a_spare_takes_the_place_of_the_node_the_gate_named_without_a_requeue(
    prepared_data, tmp_path: Path
) -> None:
    """``--health-check --retries 1 --spare-nodes 1`` with n1 slowed: the allocation is n1, n2 and the
    spare n3; the gate (on n1 and n2) names n1, the controller takes that for its first attempt's
    failure and runs the next on n3 and n2, in the same allocation (one run in ``sacct``), and the job
    trains. (Without a spare the controller requeues the job without the node: the node-local test.)"""
    until("3 idle nodes", lambda: len(_idle_nodes()) >= 3, timeout=120)
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    args = [*prepared_data, *FAST, "--max-steps", "3", "--run-dir", str(run_dir)]
    flags = ["--health-check", "--retries", "1", "--retry-backoff-s", "1", "--spare-nodes", "1"]
    terminal = ("succeeded", "failed", "cancelled", "checkpointed", "lost")
    with slowed(_slurmd("n1")):
        proc = launcher(jobs, "submit", *SLURM_2x1, *flags, "--", *args, timeout=120)
        assert proc.returncode == 0, proc.stderr[-4000:]
        job_id = proc.stdout.splitlines()[0]
        status = until(
            "the job ended", lambda: (s := status_json(jobs, job_id))["state"] in terminal and s, 600
        )
    assert status["state"] == "succeeded", status
    (first,) = status["attempts"]
    assert (first["exit_code"], first["replaced"]) == (3, {"n1": "n3"}), first
    assert "the health gate named 1 node(s):\n  n1: compute " in first["cause"], first
    runs = sacct(slurm_id_of(jobs, job_id), "State,NodeList", duplicates=True)  # a requeue adds a run
    assert len(runs) == 1 and hostnames(runs[0][1]) == ["n1", "n2", "n3"], runs
    assert [m["step"] for m in metrics(run_dir) if "tokens_per_s" in m] == [1, 2, 3]


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--partition", "nosuch"], "invalid partition"), (["--nodes", "5"], "more processors requested")],
)
def test_slurm_refusals_are_clear_errors_and_leave_no_record(
    args: list[str], needle: str, prepared_data, tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs"
    proc = launcher(jobs, "submit", *SLURM_2x1, *args, "--", *prepared_data, "--max-steps", "2")
    assert proc.returncode == 2
    assert "SLURM refused the job" in proc.stderr and needle in proc.stderr.lower()
    assert "Traceback" not in proc.stderr
    assert not jobs.exists() or not any(jobs.iterdir())


def test_a_stopped_rank_is_a_hang_named_by_the_node_tasks(prepared_data, tmp_path: Path) -> None:
    """Each node's task watches its ranks' heartbeats (in the shared job record); both report and the
    job ends as a hang naming the stopped rank, with every rank's stack kept."""
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    args = trainer_args(prepared_data, run_dir, 100000)
    proc = launcher(jobs, "submit", *SLURM_2x1, "--hang-timeout-s", "10", "--", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    job_id = proc.stdout.splitlines()[0]
    until("step 3", lambda: reached(run_dir, 3), timeout=300)
    (rank1,) = [p for p in processes_of(job_id) if is_rank(p.cmdline()) and p.environ().get("RANK") == "1"]
    frozen = time.monotonic()
    rank1.suspend()  # SIGSTOP
    terminal = ("succeeded", "failed", "cancelled", "checkpointed", "lost")
    try:
        status = until(
            "the job ended", lambda: (s := status_json(jobs, job_id))["state"] in terminal and s, 150
        )
    finally:
        with contextlib.suppress(psutil.Error):
            rank1.resume()
    took = time.monotonic() - frozen
    assert status["state"] == "failed", status
    message = status["message"]
    assert "rank 1 (node " in message and ") is stopped (SIGSTOP?)" in message, message
    stacks = {p.name.split("-")[1]: p.read_text() for p in (jobs / job_id / "hang").iterdir()}
    assert sorted(stacks) == ["rank0.txt", "rank1.txt"] and all("Python v" in t for t in stacks.values())
    until("no process of the job", lambda: not processes_of(job_id), timeout=60)
    print(f"\n{message}\nreported {took:.1f} s after the freeze")


def test_a_sweep_is_one_job_array_its_tasks_one_at_a_time_each_a_whole_job(tmp_path: Path) -> None:
    """``--sweep`` on SLURM: one job array (``--array=0-1%1``, through submitit), each task one run's
    whole job with its own checks before training, its value and the sweep's group for trackers;
    ``--max-parallel 1``: the second task starts once the first ended."""
    (tmp_path / "sweep_me.py").write_text(
        "import os, sys\nfrom pathlib import Path\nout = Path(os.environ['GPTLAUNCH_RUN_DIR'])\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'got.txt').write_text(sys.argv[2] + ' ' + os.environ['WANDB_RUN_GROUP'])\n"
    )
    jobs = tmp_path / "jobs"
    argv = ["submit", "--scheduler", "slurm", "--nodes", "1", "--gpus-per-node", "1", "--time", "15"]
    argv += ["--workdir", str(tmp_path), "--sweep", "lr=1,2", "--max-parallel", "1", "--wait"]
    proc = launcher(jobs, *argv, "--", "sweep_me.py", "--lr", "{lr}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep_id = only_job_id(jobs)
    runs = [jobs / sweep_id / f"{sweep_id}-{k}" for k in (0, 1)]
    assert [(run / "run" / "got.txt").read_text() for run in runs] == [f"1 {sweep_id}", f"2 {sweep_id}"]
    tasks = [slurm_id_of(jobs / sweep_id, run.name) for run in runs]
    array = tasks[0].split("_")[0]
    assert tasks == [f"{array}_0", f"{array}_1"]  # one array, a task per run
    rows = sacct(array, "JobID", "JobName", "State", "Start", "End")
    assert [(r[0], r[1], r[2]) for r in rows] == [(t, sweep_id, "COMPLETED") for t in tasks], rows
    assert rows[1][3] >= rows[0][4]  # ISO times: at most one task at once
    assert all((run / "parity").is_dir() for run in runs)  # each run's own checks before training
