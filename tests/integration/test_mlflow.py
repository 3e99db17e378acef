"""The built-in trainer's MLflow run across a retry, in a sweep: two real local runs with ``--mlflow``
(MLflow's own file store) and ``--retries 1``, each one's rank 0 SIGKILLed at step 15, between two
checkpoints and two evaluations (an injected fault: exact under any load, where a kill from outside
landed after step 20 on a loaded machine). Each retry goes on in its run's MLflow run, found by the
run's id (its job's), which holds every step's loss once per attempt that logged it, and each
validation loss once; each run of the sweep has its own MLflow run, in the sweep's group."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from launcher.job.record import Attempt
from tests.conftest import missing_component
from tests.integration.conftest import FAST, launcher, losses, only_job_id
from trainer.faults import FAULT_ENV
from trainer.tracking import RUN_TAG

STEPS = 30
KILLED_AT = 15  # after step 10's checkpoint and evaluation, before step 20's


def test_a_sweeps_retried_run_logs_every_step_into_one_mlflow_run(
    prepared_data: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if importlib.util.find_spec("mlflow") is None:
        missing_component("mlflow-skinny is not installed (the dev extra has it): pip install -e '.[dev]'")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the trainer opens a file store by itself
    uri, jobs = f"file://{tmp_path}/mlruns", tmp_path / "jobs"
    trainer = [*prepared_data, *FAST, "--checkpoint-interval", "10", "--eval-interval", "10"]
    sweep = ["--sweep", "seed=1,2", "--max-parallel", "1"]
    argv = ["submit", "--detach", "--nodes", "1", "--retries", "1", *sweep, "--", *trainer, "--mlflow", uri]
    proc = launcher(jobs, *argv, "--max-steps", str(STEPS), env={FAULT_ENV: f"0:{KILLED_AT}:SIGKILL"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep_id = only_job_id(jobs)
    job_dirs = [jobs / sweep_id / f"{sweep_id}-{k}" for k in (0, 1)]
    assert launcher(jobs, "wait", sweep_id, timeout=300).returncode == 0
    for job_dir in job_dirs:
        first = Attempt.model_validate_json((job_dir / "attempts" / "1" / "attempt.json").read_text())
        assert "rank 0 was killed by SIGKILL" in first.cause, first
        assert "resumed from" in (job_dir / "node-0.log").read_text()  # the retry went on from its state

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's reads of the store, below
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("gpt")
    assert experiment is not None
    runs = {r.data.tags[RUN_TAG]: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == [d.name for d in job_dirs]  # one MLflow run per sweep run, retry or not
    for job_dir in job_dirs:
        run = runs[job_dir.name]
        assert run.info.run_name == job_dir.name and run.info.status == "FINISHED"
        assert run.data.tags["gptlaunch.sweep_id"] == sweep_id
        assert run.data.params["max_steps"] == str(STEPS) and "mlflow" not in run.data.params
        history = client.get_metric_history(run.info.run_id, "loss")
        assert {m.step for m in history} == set(range(1, STEPS + 1))
        # Steps the killed attempt logged after the state its retry resumed from were logged again by
        # the retry: MLflow keeps both, in the order logged, and the later is the one metrics.jsonl
        # keeps (the retry's).
        assert {m.step: m.value for m in history} == losses(job_dir / "run")
        assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [10, 20, 30]
