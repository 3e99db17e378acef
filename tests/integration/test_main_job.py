"""The main job: `launcher submit --nodes 2 --gpus-per-node 1` trains on WikiText, then resumes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.integration.conftest import FAST, launcher, losses, metrics, only_job_id, processes_of, run


def test_two_node_job_learns_checkpoints_and_a_second_submit_resumes(prepared_data, tmp_path: Path) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    args = [
        "submit",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--",
        *prepared_data,
        *FAST,
        "--run-dir",
        str(run_dir),
        "--eval-interval",
        "15",
    ]
    first = launcher(jobs, *args, "--max-steps", "30")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for rank in (0, 1):  # both ranks ran, each on its own emulated node
        assert f"[rank{rank}]: rank {rank}/2 " in first.stdout
    assert "node0 | " in first.stdout and "node1 | " in first.stdout

    loss = losses(run_dir)
    assert sorted(loss) == list(range(1, 31))
    last5 = sum(loss[s] for s in range(26, 31)) / 5
    assert loss[1] - last5 >= 1.5, f"loss went from {loss[1]:.3f} to {last5:.3f}"
    evals = [m for m in metrics(run_dir) if "val_loss" in m]
    assert [m["step"] for m in evals] == [15, 30] and all(m["val_ppl"] > 1 for m in evals)
    assert all(
        m["world_size"] == 2 and m["tokens_per_s"] > 0 and 0 < m["mfu"] < 1
        for m in metrics(run_dir)
        if "mfu" in m
    )
    assert (run_dir / "ckpt-00000030.pt").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))

    job_id = only_job_id(jobs)
    assert not processes_of(job_id)
    status = json.loads(launcher(jobs, "status", job_id, "--json", check=True).stdout)
    assert status["state"] == "succeeded" and status["exit_code"] == 0
    assert job_id in launcher(jobs, "list", check=True).stdout
    node1 = launcher(jobs, "logs", job_id, "--node", "1", check=True).stdout
    assert node1.startswith("node1 | [rank") and "node0 |" not in node1

    second = launcher(jobs, *args, "--max-steps", "34")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "at step 30" in second.stdout
    assert sorted(losses(run_dir)) == list(range(1, 35))  # steps 31-34 appended, none repeated

    sample = run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "sample",
            "--run-dir",
            str(run_dir),
            "--prompt",
            "The",
            "--max-new-tokens",
            "20",
        ],
        check=True,
    )
    assert sample.stdout.startswith("The") and len(sample.stdout.split()) > 3
