"""The built-in trainer's MLflow run across a retry: a real local job with ``--mlflow`` (MLflow's own
file store) and ``--retries 1``, its rank 0 SIGKILLed after a checkpoint. The retry goes on in the same
MLflow run, found by the job's id, and that one run holds every step's loss."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest

from launcher.job.follow import wait_terminal
from launcher.job.record import Attempt, JobRecord
from launcher.schedulers.local.scheduler import LocalScheduler
from tests.conftest import missing_component
from tests.integration.conftest import FAST, launcher, losses, only_job_id, wait_for, wait_for_steps
from trainer.checkpoint import list_checkpoints
from trainer.tracking import RUN_TAG

STEPS = 30


def test_a_retried_job_logs_every_step_into_one_mlflow_run(
    prepared_data: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if importlib.util.find_spec("mlflow") is None:
        missing_component("mlflow-skinny is not installed (the dev extra has it): pip install -e '.[dev]'")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the trainer opens a file store by itself
    uri, run_dir, jobs = f"file://{tmp_path}/mlruns", tmp_path / "run", tmp_path / "jobs"
    trainer = [*prepared_data, *FAST, "--checkpoint-interval", "10", "--eval-interval", "10"]
    argv = ["submit", "--detach", "--nodes", "1", "--retries", "1", "--", *trainer, "--mlflow", uri]
    proc = launcher(jobs, *argv, "--max-steps", str(STEPS), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_dir = jobs / only_job_id(jobs)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's reads of the store, below
    wait_for(lambda: list_checkpoints(run_dir), 120, "the checkpoint of step 10")
    (beat,) = wait_for_steps([job_dir / "heartbeat" / "node-0"], step=11, ranks=1)
    os.kill(beat.pid, signal.SIGKILL)
    final = wait_terminal(LocalScheduler(), JobRecord(job_dir), 120, poll_s=0.2)
    assert final is not None and final.state == "succeeded", final
    first = Attempt.model_validate_json((job_dir / "attempts" / "1" / "attempt.json").read_text())
    assert "rank 0 was killed by SIGKILL" in first.cause, first
    assert "resumed from" in (job_dir / "node-0.log").read_text()  # the retry went on from a checkpoint

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("gpt")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])  # one run in the store: the job's
    assert run.data.tags[RUN_TAG] == run.info.run_name == job_dir.name and run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == str(STEPS) and "mlflow" not in run.data.params
    history = client.get_metric_history(run.info.run_id, "loss")
    assert {m.step for m in history} == set(range(1, STEPS + 1))
    # Steps the killed attempt logged after its checkpoint were logged again by the retry: MLflow keeps
    # both, in the order logged, and the later is the loss metrics.jsonl keeps (the retry's).
    assert {m.step: m.value for m in history} == losses(run_dir)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [10, 20, 30]
