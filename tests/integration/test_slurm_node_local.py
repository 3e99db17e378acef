"""SLURM jobs whose run dir is on each node's own disk, against the dev cluster: the job record keeps
a copy of it, a lost node's checkpoint comes back from that copy, and a retry that cannot have the
newest checkpoint is refused."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import (
    FAST,
    TINY,
    launcher,
    losses,
    metrics,
    processes_of,
    run,
)
from tests.integration.slurm_helpers import (
    SLURM_2x1,
    hostnames,
    is_rank,
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
)

pytestmark = pytest.mark.beside  # see conftest.pytest_collection_modifyitems

SLURM_STATE = Path(os.environ.get("GPTLAUNCH_SLURM_DIR", "/var/lib/gptlaunch-slurm"))
NODE_LOCAL = SLURM_STATE / "local"  # on each node, its own disk (deploy/slurm/dev-cluster.sh)


def _node_disk(host: str) -> Path:
    """What node ``host`` sees at NODE_LOCAL, as this machine sees it."""
    disk = SLURM_STATE / "node-local" / host
    assert disk.is_dir(), f"no node-local disk {disk}: restart the cluster (dev-cluster.sh down, then up)"
    return disk


@pytest.fixture
def node_local_name(tmp_path: Path) -> Iterator[str]:
    """A run dir name of this test's own on every node's disk, removed after it. The disks outlive
    pytest's tmp dirs (and a job that outlived its test may write there after the removal): a name
    another run of the suite used would hold that run's checkpoints and steps."""
    name = f"run-{tmp_path.name}-{secrets.token_hex(4)}"
    yield name
    for disk in (SLURM_STATE / "node-local").glob(f"*/{name}"):
        shutil.rmtree(disk, ignore_errors=True)


def _node_local_job(prepared_data, tmp_path: Path, name: str, steps: int) -> tuple[Path, str]:
    """A 2-node job with ``--retries 1`` whose run dir is on each node's own disk (not declared: the
    nodes miss the launcher's mark) named ``name``, checkpointing every 5 steps; (jobs, job id). Once
    step 7 passed and a checkpoint is in the job record's copy, its ranks held (SIGSTOP)."""
    jobs = tmp_path / "jobs"
    # TINY: steps slow enough that rank 0 still trains when the copy holds a checkpoint
    args = [*prepared_data, *FAST, *TINY, "--max-steps", str(steps), "--run-dir", str(NODE_LOCAL / name)]
    args += ["--checkpoint-interval", "5", "--eval-interval", "100000"]
    flags = ["--retries", "1", "--retry-backoff-s", "1"]
    proc = launcher(jobs, "submit", *SLURM_2x1, *flags, "--", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    job_id = proc.stdout.splitlines()[0]
    disks = [_node_disk(host) / name for host in hostnames("ALL")]
    copy = jobs / job_id / "run-copy"
    saved = [(d / "ckpt-00000005.pt", d / "ckpt-00000005.pt.sha256") for d in disks]
    until("step 7, step 5 saved", lambda: any(reached(d, 7) for d in disks) and any(
        pt.is_file() and digest.is_file() for pt, digest in saved), 300)  # fmt: skip
    # Held (SIGSTOP) until the node is lost: the job must not end before the copy holds a checkpoint
    # (the nodes' copies can lag the steps on a loaded machine).
    _signal_ranks(job_id, signal.SIGSTOP)
    until("a checkpoint in the job record's copy", lambda: list(copy.glob("ckpt-*.pt")), 300)
    assert not (NODE_LOCAL / name / "metrics.jsonl").exists()  # the launcher's machine sees none of it
    return jobs, job_id


def _ranks(job_id: str) -> list[psutil.Process]:
    """The job's live trainer ranks, on every node (one ending as it is looked at is not)."""
    found = []
    for proc in processes_of(job_id):
        with contextlib.suppress(psutil.Error):
            if is_rank(proc.cmdline()):
                found.append(proc)
    return found


def _signal_ranks(job_id: str, sig: int) -> None:
    """``sig`` to every trainer rank of the job (both nodes')."""
    ranks = until("both ranks", lambda: len(r := _ranks(job_id)) == 2 and r, 60)
    for rank in ranks:
        with contextlib.suppress(psutil.Error):
            rank.send_signal(sig)


def _lose_rank_0s_node(job_id: str) -> str:
    """SIGKILL the task of the node that holds rank 0 (and so its checkpoints); that node's name."""
    (rank0,) = [p for p in processes_of(job_id) if is_rank(p.cmdline()) and p.environ().get("RANK") == "0"]
    # the node agent (its srun step; the old node task: submitit's process)
    (task,) = [p for p in rank0.parents() if {"launcher.agent", "submitit.core._submit"} & {*p.cmdline()}]
    host = str(rank0.environ()["SLURMD_NODENAME"])  # before the kill: the node's tree ends with its agent
    task.kill()
    for rank in [rank0, *_ranks(job_id)]:  # a lost node's processes are gone at once (held: no exit of
        with contextlib.suppress(psutil.Error):  # their own); the held survivor goes on, its peer gone
            rank.send_signal(signal.SIGKILL if rank == rank0 else signal.SIGCONT)
    return host


def test_a_node_local_run_dir_survives_the_loss_of_rank_0s_node(
    prepared_data, tmp_path: Path, node_local_name: str
) -> None:
    """``--retries 1``, a 2-node job on the 3-node cluster: the node holding rank 0 and its checkpoints
    is lost (its task, submitit's process, parent of its torchrun agent, SIGKILLed after a checkpoint).
    The batch script requeues the job without that node; attempt 2 runs on the two other nodes, which
    never held a checkpoint, restores the job record's copy on both, resumes from it and trains
    exactly ``--max-steps`` steps, each logged once."""
    steps = 30
    name = node_local_name
    jobs, job_id = _node_local_job(prepared_data, tmp_path, name, steps)
    failed = _lose_rank_0s_node(job_id)
    terminal = ("succeeded", "failed", "cancelled", "checkpointed", "lost")
    status = until("the job ended", lambda: (s := status_json(jobs, job_id))["state"] in terminal and s, 300)
    assert status["state"] == "succeeded", status
    (first,) = status["attempts"]
    assert first["excluded"] == [failed], first
    copy = jobs / job_id / "run-copy"
    logged = [m["step"] for m in metrics(copy) if "tokens_per_s" in m]
    assert logged == list(range(1, steps + 1))  # from the copy: resumed, no step twice, none missing
    assert (copy / f"ckpt-{steps:08d}.pt").is_file()
    logs = "".join((jobs / job_id / f"node-{k}.log").read_text() for k in (0, 1))
    for said in ("task: restored", "resumed from", "task: run dir copy"):
        assert said in logs, logs[-3000:]
    page = Path(launcher(jobs, "report", job_id, check=True).stdout.strip()).read_text()
    assert '<div id="chart-loss"' in page, "the curves come from the job record's copy of the run dir"
    # The attempt's line names the node excluded, then its start-up (``launcher.job.startup``)
    excluded = rf"attempt 1: failed at step [^<]*\({failed}\)(; first step [^<]*)?</li>"
    assert re.search(excluded, page), page[-3000:]
    (nodelist,) = sacct(slurm_id_of(jobs, job_id), "NodeList")[0]  # the last run's
    assert failed not in hostnames(nodelist) and len(hostnames(nodelist)) == 2, nodelist
    assert not (_node_disk(failed) / name / f"ckpt-{steps:08d}.pt").exists()  # not where it ended
    assert (jobs / job_id / "attempts" / "1" / "node-0.log").is_file()  # attempt 1 keeps its logs
    text = launcher(jobs, "status", job_id, check=True).stdout
    assert "attempt 2 of 2" in text and f"{failed} excluded" in text, text
    until("no process of the job", lambda: not processes_of(job_id), timeout=60)


def test_a_retry_refuses_to_start_over_when_the_copy_lost_the_newest_checkpoint(
    prepared_data, tmp_path: Path, node_local_name: str
) -> None:
    """As above, but the job record's copy is gone too: attempt 2 does not quietly train from step 0;
    it fails, naming the checkpoint, where it was saved and ``--allow-start-over``."""
    jobs, job_id = _node_local_job(prepared_data, tmp_path, node_local_name, 200)
    failed = _lose_rank_0s_node(job_id)
    # once the controller requeued the job: the survivor's last save is in the copy by then
    until("requeued", lambda: json.loads((jobs / job_id / "status.json").read_text())["state"] == "pending")
    shutil.rmtree(jobs / job_id / "run-copy")
    terminal = ("succeeded", "failed", "cancelled", "checkpointed", "lost")
    status = until("the job ended", lambda: (s := status_json(jobs, job_id))["state"] in terminal and s, 300)
    assert status["state"] == "failed" and status["exit_code"] == 3, status
    message = status["message"]
    for words in (
        "the newest checkpoint (ckpt-",
        f"on {failed}",
        "is not in its copy",
        "--allow-start-over",
    ):
        assert words in message, message
    assert len(status["attempts"]) == 1  # attempt 2 was refused, not retried
    logs = "".join(p.read_text() for p in (jobs / job_id).glob("node-*.log"))
    assert "task: not started: the newest checkpoint" in logs, logs[-3000:]
    until("no process of the job", lambda: not processes_of(job_id), timeout=60)


def test_the_sbatch_script_with_a_node_local_run_dir_requeues_and_resumes_from_the_copy(
    prepared_data, tmp_path: Path, node_local_name: str
) -> None:
    """The standalone script (``launcher render``, run with plain sbatch), told the run dir is
    node-local: on SLURM's warning signal the stop marker and the checkpoint reach the job record's
    copy, the script requeues the job, and the next run restores the copy and trains exactly to the
    end. (The same script's requeue with a shared run dir is submitit's: the preemption test.)"""
    jobs, name = tmp_path / "jobs", node_local_name
    args = trainer_args(prepared_data, NODE_LOCAL / name, 40)
    slurm_id = sbatch_rendered(jobs, tmp_path, args, "--node-local-run-dir")
    disks = [_node_disk(host) / name for host in hostnames("ALL")]
    until("step 5", lambda: any(reached(d, 5) for d in disks))
    run(["scancel", "--signal=USR2", "--full", slurm_id], check=True)
    until_ended(slurm_id, timeout=600)
    assert [r[0] for r in sacct(slurm_id, "State", duplicates=True)] == ["REQUEUED", "COMPLETED"]
    assert sacct(slurm_id, "State,ExitCode") == [["COMPLETED", "0:0"]]
    (job_dir,) = jobs.iterdir()
    copy = job_dir / "run-copy"
    assert sorted(losses(copy)) == list(range(1, 41))  # resumed: no step twice
    assert {m["world_size"] for m in metrics(copy) if "world_size" in m} == {2}
    assert sorted(p.name for p in job_dir.glob("node-*.log")) == ["node-0.log", "node-1.log"]
    assert "task: run dir copy" in "".join(p.read_text() for p in job_dir.glob("node-*.log"))
