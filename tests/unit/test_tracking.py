"""MLflow tracking (``trainer.tracking``) against MLflow's own local file store, with a real client and
no server: a job's run made once and found again by its tag on a retry, metrics logged at their
optimizer step, params once; a store that fails costs one warning and never an exception; and
``--mlflow`` without mlflow installed is refused before training (exit 2, naming the fix)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gptlaunch import runtime
from tests.conftest import REPO_ROOT, missing_component
from trainer import cli, tracking
from trainer.config import TrainConfig
from trainer.errors import ConfigError
from trainer.tracking import RUN_NAME_TAG, RUN_TAG, SWEEP_TAG, MlflowRun, open_run, params_of


@pytest.fixture
def installed() -> None:
    """mlflow can be imported (a failure under CI=true, whose dev extra installs it; else a skip)."""
    if importlib.util.find_spec("mlflow") is None:
        missing_component("mlflow-skinny is not installed (the dev extra has it): pip install -e '.[dev]'")


@pytest.fixture
def uri(installed: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh MLflow file store (MLflow 3 opens one only when MLFLOW_ALLOW_FILE_STORE says so)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file://{tmp_path}/mlruns"


@pytest.fixture
def client(uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


@pytest.fixture
def runs() -> Iterator[list[MlflowRun]]:
    """The MlflowRuns a test makes, closed after it if the test did not (their threads end)."""
    made: list[MlflowRun] = []
    yield made
    for run in made:
        run.close("FAILED", timeout_s=5)


def _history(client: Any, mlflow_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(mlflow_id, key)]


def test_a_jobs_run_is_made_once_with_its_tags_then_found_again_and_running(client: Any) -> None:
    first, existed = open_run(client, "gpt", "job-1", sweep_id="sweep-a")
    assert not existed
    tags = client.get_run(first).data.tags
    assert (tags[RUN_TAG], tags[RUN_NAME_TAG], tags[SWEEP_TAG]) == ("job-1", "job-1", "sweep-a")
    client.set_terminated(first, status="FAILED")  # the first attempt failed
    again, existed = open_run(client, "gpt", "job-1")
    assert (again, existed) == (first, True)
    assert client.get_run(first).info.status == "RUNNING"
    other, existed = open_run(client, "gpt", "job-2")
    assert other != first and not existed and SWEEP_TAG not in client.get_run(other).data.tags
    # No run id (bare torchrun): a new run each time.
    anonymous = {open_run(client, "gpt", None)[0] for _ in range(2)}
    assert len(anonymous) == 2 and not anonymous & {first, other}
    (experiment,) = [e for e in client.search_experiments() if e.name == "gpt"]
    assert len(client.search_runs([experiment.experiment_id])) == 4


def test_the_trainers_run_is_the_jobs_in_its_sweep(
    uri: str, client: Any, monkeypatch: pytest.MonkeyPatch, runs: list[MlflowRun]
) -> None:
    """What the launcher sets on every rank names the run: GPTLAUNCH_RUN_ID, GPTLAUNCH_SWEEP_ID."""
    assert tracking.start(TrainConfig()) is None  # no --mlflow
    monkeypatch.setenv("GPTLAUNCH_RUN_ID", "job-9")
    monkeypatch.setenv("GPTLAUNCH_SWEEP_ID", "sweep-3")
    run = tracking.start(TrainConfig(mlflow=uri, mlflow_experiment="exp"))
    assert run is not None
    runs.append(run)
    run.close("FINISHED")
    assert run.mlflow_id is not None
    tags = client.get_run(run.mlflow_id).data.tags
    assert (tags[RUN_TAG], tags[SWEEP_TAG]) == ("job-9", "sweep-3")
    assert (
        client.get_experiment_by_name("exp").experiment_id == client.get_run(run.mlflow_id).info.experiment_id
    )
    monkeypatch.delenv("GPTLAUNCH_RUN_ID")  # bare torchrun
    assert runtime.run_id() is None


def test_a_run_id_with_a_quote_is_still_found(client: Any) -> None:
    made, _ = open_run(client, "gpt", "it's")
    assert open_run(client, "gpt", "it's") == (made, True)
    with pytest.raises(ValueError, match="both kinds of quote"):
        open_run(client, "gpt", 'it\'s "odd"')


def test_a_deleted_experiment_is_named(client: Any) -> None:
    client.delete_experiment(client.create_experiment("old"))
    with pytest.raises(ValueError, match="'old' is deleted"):
        open_run(client, "old", "job-1")


def test_metrics_go_in_at_their_step_and_a_retry_goes_on_in_the_same_run(
    uri: str, client: Any, runs: list[MlflowRun], capsys: pytest.CaptureFixture[str]
) -> None:
    params = params_of(TrainConfig(max_steps=3, mlflow=uri))
    assert (
        "mlflow" not in params
        and params["max_steps"] == "3"
        and params["stop_signals"] == '["SIGTERM", "SIGUSR2"]'
    )
    runs.append(first := MlflowRun(uri, "gpt", params, "job-1", None))
    for step, loss in ((1, 9.0), (2, 8.0)):
        first.log({"step": step, "loss": loss, "lr": 1e-3, "tokens_per_s": 5e3, "mfu": 0.01, "world_size": 2})
    first.log({"step": 2, "checkpoint_mb": 4.0})  # nothing of METRICS: nothing logged
    assert first.sync(timeout_s=30)
    assert first.mlflow_id is not None and not first.resumed
    assert _history(client, first.mlflow_id, "loss") == [(1, 9.0), (2, 8.0)]
    first.log({"step": 3, "loss": 7.5})  # logged after the checkpoint of step 2: the retry redoes it
    first.close("FAILED")
    assert client.get_run(first.mlflow_id).info.status == "FAILED"

    # The retry (another max_steps: a param keeps its first value), resumed at step 2's checkpoint.
    runs.append(
        second := MlflowRun(uri, "gpt", params_of(TrainConfig(max_steps=4, mlflow=uri)), "job-1", None)
    )
    second.log({"step": 3, "loss": 7.0})
    second.log({"step": 3, "loss": 7.0, "val_loss": 7.25, "val_ppl": 1408.1})  # an evaluation's record
    second.close("FINISHED")
    assert (second.mlflow_id, second.resumed) == (first.mlflow_id, True)
    run = client.get_run(first.mlflow_id)
    assert run.info.status == "FINISHED" and run.data.params["max_steps"] == "3"
    assert _history(client, first.mlflow_id, "loss") == [(1, 9.0), (2, 8.0), (3, 7.5), (3, 7.0), (3, 7.0)]
    assert _history(client, first.mlflow_id, "val_loss") == [(3, 7.25)]
    assert _history(client, first.mlflow_id, "mfu") == [(1, 0.01), (2, 0.01)]
    assert "world_size" not in run.data.metrics and "checkpoint_mb" not in run.data.metrics
    assert "MLflow" not in capsys.readouterr().err


def test_a_store_that_cannot_be_opened_costs_one_warning_and_no_exception(
    installed: None, runs: list[MlflowRun], capsys: pytest.CaptureFixture[str]
) -> None:
    runs.append(run := MlflowRun("file:///dev/null/mlruns", "gpt", {}, "job-1", None))
    for step in (1, 2, 3):
        run.log({"step": step, "loss": 1.0})
        assert run.sync(timeout_s=30)
    run.close("FINISHED", timeout_s=30)
    assert run.failed and run.mlflow_id is None
    err = capsys.readouterr().err
    assert err.count("MLflow tracking at file:///dev/null/mlruns failed") == 1, err
    assert "training goes on without it" in err


def test_a_store_lost_mid_run_costs_one_warning_and_no_exception(
    uri: str, tmp_path: Path, runs: list[MlflowRun], capsys: pytest.CaptureFixture[str]
) -> None:
    runs.append(run := MlflowRun(uri, "gpt", {}, "job-1", None))
    run.log({"step": 1, "loss": 1.0})
    assert run.sync(timeout_s=30) and not run.failed
    shutil.rmtree(tmp_path / "mlruns")  # the tracker's store is gone: every write from now on fails
    for step in (2, 3):
        run.log({"step": step, "loss": 1.0})
    assert run.sync(timeout_s=30)
    run.close("FINISHED", timeout_s=30)
    assert run.failed
    assert capsys.readouterr().err.count("MLflow tracking at") == 1


def test_mlflow_not_installed_is_refused_before_training_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: find_spec finds nothing
    tracking.check_installed(None)  # no --mlflow: no need
    with pytest.raises(ConfigError, match="pip install mlflow-skinny"):
        tracking.check_installed("http://tracker:5000")
    run_dir = tmp_path / "run"
    code = cli.main(["train", "--mlflow", "http://u:secret@tracker:5000", "--run-dir", str(run_dir)])
    err = capfd.readouterr().err
    assert code == 2 and "pip install mlflow-skinny" in err and "gptlaunch[mlflow]" in err, err
    assert "secret" not in err and "http://u:***@tracker:5000" in err
    assert not run_dir.exists()  # refused before anything was written


def test_how_an_attempt_ended_is_the_runs_status() -> None:
    assert tracking.status_of(None, stopped=False) == "FINISHED"
    assert tracking.status_of(None, stopped=True) == "KILLED"
    assert tracking.status_of(RuntimeError("lost a peer"), stopped=False) == "FAILED"
    assert tracking.status_of(KeyboardInterrupt(), stopped=False) == "KILLED"


def test_mlflow_is_imported_only_with_mlflow() -> None:
    """The trainer's modules import no mlflow: a run without --mlflow pays nothing for it."""
    code = "import sys, trainer.cli, trainer.train, trainer.tracking; print('mlflow' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
