"""MLflow tracking (``--mlflow URI``): rank 0 logs the run's config and each log interval's metrics
into one MLflow run per launcher job, which the job's later attempts go on in.

The MLflow run is found by its tag ``gptlaunch.run_id``, the job's id: the launcher gives it to every
rank as ``GPTLAUNCH_RUN_ID`` (``runtime.run_id()``), the same on every attempt, retry and requeue. A
later attempt finds the run an earlier one made and continues it (the same MLflow run id, RUNNING
again, metrics appended); without the variable (bare torchrun) each start makes a new run. A resumed
trainer continues at its checkpoint's step, so the steps it logs follow those already logged, except
the few that a failed attempt had logged after its last checkpoint: those are logged again with the
same step numbers, and MLflow keeps both values in the metric's history (the later is the resumed
run's, the one ``metrics.jsonl`` keeps). Before each checkpoint or snapshot, rank 0 waits (a bounded
time) until every record so far is written, so that a retry resumes after steps MLflow has; a rank 0
killed outright (SIGKILL) loses only what it logged since.

As TensorBoard's writer does, the writes happen on a thread of their own, so that a slow or lost
tracking server never holds up a step. Network trackers fail: the first error (after MLflow's client
has retried the request itself) prints one warning, also shown in ``launcher status``, and ends the
tracking for this attempt, while training goes on with ``metrics.jsonl`` and TensorBoard whole; the
next attempt tries again. ``mlflow`` (from ``mlflow-skinny``) is imported on that thread, and only
with ``--mlflow``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from gptlaunch import runtime
from trainer.config import TrainConfig
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from mlflow import MlflowClient

RUN_TAG = "gptlaunch.run_id"  # the job's id: finds the run again on a retry
SWEEP_TAG = "gptlaunch.sweep_id"
RUN_NAME_TAG = "mlflow.runName"  # MLflow's own tag: the name its UI shows
# A metrics record's keys that MLflow gets: the loss and learning rate, throughput, and an evaluation's.
METRICS = ("loss", "val_loss", "val_ppl", "lr", "tokens_per_s", "mfu")
INSTALL_FIX = "pip install mlflow-skinny (or the project's extra: pip install 'gptlaunch[mlflow]')"
PARAM_MAX_CHARS = 500  # older MLflow servers refuse longer param values (newer ones take 6,000)
PARAMS_PER_BATCH = 100  # MLflow's limit of params in one log_batch request
SYNC_TIMEOUT_S = 10.0  # the most a checkpoint waits for the metrics before it to be written
CLOSE_TIMEOUT_S = 15.0  # the most the end of training waits for the last writes and the run's status
# MLflow's run statuses (mlflow.entities.RunStatus): how the attempt ended.
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


def check_installed(uri: str | None) -> None:
    """With ``--mlflow`` (``uri`` not None): raise ConfigError (the trainer exits 2, before training)
    when the ``mlflow`` package cannot be imported, naming the fix."""
    if uri is not None and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(f"--mlflow {shown(uri)}: the mlflow package is not installed; fix: {INSTALL_FIX}")


def start(cfg: TrainConfig) -> MlflowRun | None:
    """Rank 0's MLflow run for ``cfg`` (None without ``--mlflow``): this job's (``runtime.run_id()``),
    in the sweep of ``runtime.sweep_id()`` when set. Never raises for the tracker's sake (see MlflowRun)."""
    if cfg.mlflow is None:
        return None
    return MlflowRun(cfg.mlflow, cfg.mlflow_experiment, params_of(cfg), runtime.run_id(), runtime.sweep_id())


def status_of(exc: BaseException | None, stopped: bool) -> str:
    """The MLflow status of an attempt that ended with ``exc`` (None: returned), ``stopped`` by a stop
    signal (after its checkpoint) or not."""
    if isinstance(exc, KeyboardInterrupt) or (exc is None and stopped):
        return KILLED
    return FAILED if exc is not None else FINISHED


def shown(uri: str) -> str:
    """``uri`` as a message may show it: without a password (``http://user:pw@host``)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    user, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{user.split(':')[0]}:***@{host}").geturl()


def params_of(cfg: TrainConfig) -> dict[str, str]:
    """The run's config as MLflow params: every TrainConfig field, each a flag as this run resolved it
    (JSON for what is not a string), cut to PARAM_MAX_CHARS; not ``--mlflow`` itself, since a
    tracking URI may hold a password."""
    values = cfg.model_dump(mode="json", exclude={"mlflow"})
    return {k: (v if isinstance(v, str) else json.dumps(v))[:PARAM_MAX_CHARS] for k, v in values.items()}


def metrics_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The METRICS that a metrics record holds (a log interval's: loss, lr, tokens_per_s, mfu; an
    evaluation's: val_loss, val_ppl), as floats."""
    return {k: float(record[k]) for k in METRICS if isinstance(record.get(k), int | float)}


def experiment_id(client: MlflowClient, name: str) -> str:
    """The id of the experiment ``name``, created when missing. Raises ValueError when it is deleted,
    MlflowException (or OSError, from a file store) when the store fails."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name)
        except MlflowException:  # a sweep's runs start together: another may have created it first
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if found.lifecycle_stage != "active":
        raise ValueError(
            f"the MLflow experiment {name!r} is deleted: restore it, or pass another --mlflow-experiment"
        )
    return str(found.experiment_id)


def open_run(
    client: MlflowClient, experiment: str, run_id: str | None, sweep_id: str | None = None
) -> tuple[str, bool]:
    """The MLflow run of the job ``run_id`` in ``experiment``: (its MLflow run id, whether it existed).
    An existing run (tagged RUN_TAG = ``run_id``; the first one made, should there be several) is set
    RUNNING again. A new one is tagged RUN_TAG, named ``run_id`` and tagged SWEEP_TAG = ``sweep_id``
    when given; with no ``run_id``, a new run with a name of MLflow's choosing. Raises ValueError for a
    ``run_id`` holding both kinds of quote, else what ``experiment_id`` raises."""
    exp = experiment_id(client, experiment)
    if run_id:
        query = f"tags.`{RUN_TAG}` = {_literal(run_id)}"
        found = client.search_runs(
            [exp], filter_string=query, max_results=1, order_by=["attributes.start_time ASC"]
        )
        if found:
            client.update_run(found[0].info.run_id, status="RUNNING")
            return str(found[0].info.run_id), True
    tags = {RUN_TAG: run_id, RUN_NAME_TAG: run_id} if run_id else {}
    if sweep_id:
        tags[SWEEP_TAG] = sweep_id
    return str(client.create_run(exp, tags=tags).info.run_id), False


def log_params(client: MlflowClient, mlflow_id: str, params: Mapping[str, str]) -> None:
    """Log the ``params`` that the run lacks: a resumed run has them already, and MLflow refuses to
    change a param, so a value that differs on a later attempt keeps the first one's."""
    from mlflow.entities import Param

    have = client.get_run(mlflow_id).data.params
    new = [Param(k, v) for k, v in params.items() if k not in have]
    for i in range(0, len(new), PARAMS_PER_BATCH):
        client.log_batch(mlflow_id, params=new[i : i + PARAMS_PER_BATCH])


def _literal(value: str) -> str:
    """``value`` as a string in an MLflow search filter. Raises ValueError when it holds both quotes."""
    for quote in ("'", '"'):
        if quote not in value:
            return f"{quote}{value}{quote}"
    raise ValueError(f"run id {value!r}: an MLflow search cannot name a value with both kinds of quote")


# What the writer thread is asked to do: log metrics, end the run, signal an Event once all before it is
# done (``sync``), or stop (None).
_Metrics = tuple[int, dict[str, float], int]  # (step, metrics, timestamp in ms since the epoch)
_Op = _Metrics | str | threading.Event | None


class MlflowRun:
    """Rank 0's MLflow run (see the module docstring), written by a thread of its own. ``log``,
    ``sync`` and ``close`` never raise and never wait on the tracker longer than their timeouts."""

    def __init__(
        self, uri: str, experiment: str, params: Mapping[str, str], run_id: str | None, sweep_id: str | None
    ) -> None:
        """Start the writer thread, which opens the run (``open_run``) and logs ``params`` first."""
        if urlsplit(uri).scheme in ("", "file"):
            # MLflow 3 refuses its file store unless this is set, and --mlflow naming one asks for it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.mlflow_id: str | None = None  # once the run is open
        self.resumed = False  # whether the run existed (an earlier attempt's)
        self.failed = False  # tracking ended for this attempt after an error (warned once)
        self._ops: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._behind: threading.Event | None = None  # a sync that timed out, until the writer gets there
        self._thread = threading.Thread(
            target=self._work, args=(experiment, dict(params), run_id, sweep_id), name="mlflow", daemon=True
        )
        self._thread.start()

    def log(self, record: Mapping[str, Any]) -> None:
        """Log ``record``'s METRICS at its ``step`` (the optimizer steps done); nothing if it has none."""
        metrics = metrics_of(record)
        if metrics and not self.failed:
            self._ops.put((int(record["step"]), metrics, int(time.time() * 1000)))

    def sync(self, timeout_s: float = SYNC_TIMEOUT_S) -> bool:
        """Wait until all logged so far is written (or dropped after an error), at most ``timeout_s``
        seconds: before a checkpoint, so that what a retry resumes after is in MLflow. Returns whether
        it was."""
        if self._behind is not None and not self._behind.is_set():
            return False  # still behind the last sync that timed out (a hung server): not another wait
        done = threading.Event()
        self._ops.put(done)
        if done.wait(timeout_s):
            return True
        self._behind = done
        return False

    def close(self, status: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """End the run with ``status`` (FINISHED, FAILED, KILLED) after the metrics logged before, waiting
        at most ``timeout_s`` seconds (a daemon thread: a hung server does not hold up the exit)."""
        self._ops.put(status)
        self._ops.put(None)
        self._thread.join(timeout_s)

    def _work(
        self, experiment: str, params: dict[str, str], run_id: str | None, sweep_id: str | None
    ) -> None:
        client = None
        try:
            client = self._open(experiment, params, run_id, sweep_id)
        except Exception as e:  # whatever the tracker raised (a network error, a refusal): training goes on
            self._fail(e)
        while (op := self._ops.get()) is not None:
            if isinstance(op, threading.Event):
                op.set()
            elif client is not None:
                try:
                    self._do(client, op)
                except Exception as e:  # as above: one warning, then no more tracking
                    self._fail(e)
                    client = None

    def _open(
        self, experiment: str, params: dict[str, str], run_id: str | None, sweep_id: str | None
    ) -> MlflowClient:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        mlflow_id, self.resumed = open_run(client, experiment, run_id, sweep_id)
        log_params(client, mlflow_id, params)
        self.mlflow_id = mlflow_id
        return client

    def _do(self, client: MlflowClient, op: _Metrics | str) -> None:
        assert self.mlflow_id is not None
        if isinstance(op, str):
            client.set_terminated(self.mlflow_id, status=op)
            return
        from mlflow.entities import Metric

        step, metrics, ms = op
        client.log_batch(self.mlflow_id, metrics=[Metric(k, v, ms, step) for k, v in metrics.items()])

    def _fail(self, e: Exception) -> None:
        self.failed = True
        first = (str(e).strip().splitlines() or [""])[0][:300]  # MLflow's messages run long
        runtime.warn(
            f"MLflow tracking at {shown(self.uri)} failed ({type(e).__name__}: {first}); training goes on "
            "without it this attempt (metrics.jsonl and TensorBoard have every step)",
            topic="tracking",
        )
