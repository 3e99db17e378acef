"""What the SLURM tests share: the dev cluster (started when it is not), sacct and scontrol, the
job's trainer arguments, and waits on a job's state."""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launcher.agent.copies import MARK
from tests.integration.conftest import (
    FAST,
    launcher,
    losses,
    missing_component,
    run,
)

ROOT = Path(__file__).resolve().parents[2]
DEV_CLUSTER = ROOT / "deploy" / "slurm" / "dev-cluster.sh"
SLURM_2x1 = ["--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "1", "--time", "15"]


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster() -> None:
    """A running dev cluster with 3 idle nodes: started here if it is not (root only)."""
    if run(["bash", str(DEV_CLUSTER), "status"], timeout=60).returncode == 0 and len(hostnames("ALL")) >= 3:
        return
    why = "needs root to start the dev SLURM cluster"
    if os.geteuid() == 0:
        up = run(["bash", str(DEV_CLUSTER), "up", "--nodes", "3"], timeout=600)
        if up.returncode == 0:
            return
        why = f"the dev SLURM cluster did not start: {up.stderr[-2000:]}"
    missing_component(f"CI must run the SLURM tests: {why}")


@pytest.fixture(autouse=True)
def slurm_queue_left_empty(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, no job left in the dev cluster's queue (cancelled, with a warning naming the
    test): a test that failed with its job running, or requeued, would hold the nodes that every later
    test's job then waits for, and fail them far from its cause. (The SLURM tests run one at a time.)"""
    yield
    left = _queued()
    if left:
        run(["scancel", *left], timeout=60)
        warnings.warn(f"{request.node.nodeid} left SLURM job(s) {left} in the queue: cancelled", stacklevel=1)
        until("the dev cluster's queue empty", lambda: not _queued(), 120)


def _queued() -> list[str]:
    return run(["squeue", "--noheader", "--format=%i"], timeout=60).stdout.split()


def hostnames(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list ("ALL": the cluster's nodes)."""
    if nodelist == "ALL":
        return run(["sinfo", "--noheader", "--Node", "--format=%N"], check=True).stdout.split()
    return run(["scontrol", "show", "hostnames", nodelist], check=True).stdout.split()


def sacct(slurm_job_id: str, *fields: str, duplicates: bool = False) -> list[list[str]]:
    argv = ["sacct", "-X", "-n", "--parsable2", "-j", slurm_job_id, "-o", ",".join(fields)]
    out = run([*argv, *(["--duplicates"] if duplicates else [])], check=True).stdout
    return [line.split("|") for line in out.splitlines()]


def slurm_id_of(jobs: Path, job_id: str) -> str:
    return str(json.loads((jobs / job_id / "handle.json").read_text())["slurm_job_id"])


def status_json(jobs: Path, job_id: str) -> dict:
    out = launcher(jobs, "status", "--json", job_id, check=True).stdout
    return dict(json.loads(out))


def until(what: str, check, timeout: float = 180.0, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def trainer_args(prepared_data: list[str], run_dir: Path, max_steps: int) -> list[str]:
    """Train ``max_steps`` steps into ``run_dir``, checkpointing only at the end or on a stop."""
    return [
        *prepared_data,
        *FAST,
        "--max-steps",
        str(max_steps),
        "--run-dir",
        str(run_dir),
        "--checkpoint-interval",
        "1000",
    ]


def sbatch_rendered(jobs: Path, tmp_path: Path, args: list[str], *flags: str) -> str:
    """Render the job's sbatch script (``flags``: more launcher flags), submit it with plain sbatch;
    the SLURM job id."""
    script = launcher(jobs, "render", *SLURM_2x1, *flags, "--", *args, check=True).stdout
    (tmp_path / "job.sbatch").write_text(script)
    assert not jobs.exists()  # rendering writes nothing
    out = run(["sbatch", "--parsable", str(tmp_path / "job.sbatch")], cwd=tmp_path, check=True).stdout
    return out.strip().split(";")[0]


def until_ended(slurm_id: str, timeout: float = 180.0) -> None:
    ended = ("COMPLETED", "FAILED", "CANCELLED")
    until(
        f"SLURM job {slurm_id} ended", lambda: any(r[0] in ended for r in sacct(slurm_id, "State")), timeout
    )


def reached(run_dir: Path, step: int) -> bool:
    return (run_dir / "metrics.jsonl").is_file() and max(losses(run_dir), default=0) >= step


def node_of(rank: psutil.Process) -> int:
    """The job's node (not torchrun's group rank, which is the order of joining) a rank runs on: its
    heartbeat directory is ``JOB/heartbeat/node-<k>``."""
    return int(rank.environ()["GPTLAUNCH_HEARTBEAT_DIR"].rsplit("-", 1)[1])


def is_rank(cmdline: list[str]) -> bool:
    """A training process (torchrun's worker), not the torchrun agent that started it."""
    torchrun = {"torch.distributed.run", "launcher.agent.torchrun"}  # as rendered, as the agent runs it
    return "trainer.cli" in cmdline and not torchrun & set(cmdline)


def untouched(run_dir: Path) -> bool:
    """Nothing in ``run_dir`` but the launcher's mark (``launcher.agent.copies.MARK``, written at submit)."""
    return sorted(p.name for p in run_dir.iterdir()) == [MARK]


def files_containing(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]
