"""Hot spares on the real dev SLURM cluster (deploy/slurm/dev-cluster.sh, three nodes): a 2-node job
with ``--spare-nodes 1`` holds all three, and its controller retries a failure on the spare within the
same allocation, with no requeue. Under CI=true a missing cluster fails these tests."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gptlaunch.contract import read_beats
from launcher.job.scalars import scalars_dir
from tests.integration.conftest import FAST, launcher, metrics, processes_of
from tests.integration.slurm_helpers import (
    SLURM_2x1,
    hostnames,
    is_rank,
    reached,
    sacct,
    slurm_cluster,  # noqa: F401 (the module's fixture: a running dev cluster)
    slurm_id_of,
    slurm_queue_left_empty,  # noqa: F401 (autouse: no job left queued after a test)
    until,
)

pytestmark = pytest.mark.beside  # see conftest.pytest_collection_modifyitems


def test_a_killed_rank_is_retried_on_the_spare_by_the_controller_in_the_same_allocation(
    prepared_data, tmp_path: Path
) -> None:
    """``--nodes 2 --spare-nodes 1 --retries 1``, no checkpoint interval before the
    end: rank 1 is SIGKILLed past step 12. The controller, in the allocation, retries at once on the
    survivor and the spare in the same SLURM job (one run in ``sacct``, no requeue), resumed at the
    step the job reached (the survivor's snapshot in memory), and trains exactly ``--max-steps``
    steps, each logged once. Its job record says so, with goodput, once ``sacct`` shows the job
    COMPLETED, before any other launcher command has read the job."""
    jobs, run_dir, steps = tmp_path / "jobs", tmp_path / "run", 30
    args = [*prepared_data, *FAST, "--max-steps", str(steps), "--run-dir", str(run_dir)]
    args += ["--checkpoint-interval", "1000", "--eval-interval", "100000"]
    flags = ["--retries", "1", "--spare-nodes", "1"]
    proc = launcher(jobs, "submit", *SLURM_2x1, *flags, "--", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    job_id = proc.stdout.splitlines()[0]
    slurm_id = slurm_id_of(jobs, job_id)
    until("step 12", lambda: reached(run_dir, 12), timeout=300)
    ranks = {p.environ()["RANK"]: p for p in processes_of(job_id) if is_rank(p.cmdline())}
    ran = sorted(p.environ()["SLURMD_NODENAME"] for p in ranks.values())
    failed = ranks["1"].environ()["SLURMD_NODENAME"]
    ranks["1"].kill()
    killed = time.time()
    back = until("the retry's first step", lambda: _first_step_resumed(jobs / job_id), 300, every=0.2)
    until("sacct: COMPLETED", lambda: sacct(slurm_id, "State")[0][0] == "COMPLETED", timeout=300)
    status = json.loads((jobs / job_id / "status.json").read_text())  # as the controller left it
    assert status["state"] == "succeeded", status
    (spare,) = set(hostnames("ALL")) - set(ran)
    (first,) = status["attempts"]
    assert first["replaced"] == {failed: spare} and first["failure"]["rank"] == 1, first
    runs = sacct(slurm_id, "State,NodeList", duplicates=True)  # a requeue adds a run
    assert len(runs) == 1 and runs[0][0] == "COMPLETED", runs
    assert sorted(hostnames(runs[0][1])) == sorted(hostnames("ALL")), runs  # one allocation, all 3
    logged = [m for m in metrics(run_dir) if "tokens_per_s" in m]
    assert [m["step"] for m in logged] == list(range(1, steps + 1))
    logs = "".join(p.read_text() for p in (jobs / job_id).glob("node-*.log"))
    resumed = re.search(r"resumed from the snapshot in \S+ memory at step (\d+)", logs)
    assert resumed is not None and int(resumed[1]) == first["step"], (first, logs[-3000:])
    _assert_tensorboard_shows_both_attempts(jobs / job_id, first["cause"])
    text = launcher(jobs, "status", job_id, check=True).stdout
    assert f"{failed} → replaced by {spare}" in text, text
    until("no process of the job", lambda: not processes_of(job_id), timeout=60)
    print(f"\nkill → the spare's first step: {back - killed:.1f} s; resumed at step {resumed[1]}\n{text}")


def _assert_tensorboard_shows_both_attempts(job_dir: Path, cause: str) -> None:
    """The controller wrote the job's numbers into its TensorBoard logs: each attempt's start with the
    cause before it, goodput (its last point as the job ended), and the ranks' compute times, read back
    with TensorBoard's own reader."""
    events = EventAccumulator(str(scalars_dir(job_dir)), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    lines = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("job/attempts")]
    assert lines == ["attempt 1 of 2 started", f"attempt 2 of 2 started after: {cause}"], lines
    assert events.Scalars("job/attempt")[-1].value == 2.0
    ratio = events.Scalars("goodput/ratio")[-1].value  # the job's, as it ended
    assert 0 < ratio < 1, ratio
    assert {"ranks/compute_s/rank_0", "ranks/compute_s/rank_1"} <= set(events.Tags()["scalars"])


def _first_step_resumed(job_dir: Path) -> float | None:
    """When a rank of a resumed attempt beat its first step (epoch seconds); None before."""
    beats = [b for node in (job_dir / "heartbeat").glob("node-*") for b in read_beats(node)]
    return next((b.time for b in beats if b.start_step and b.step > b.start_step), None)
