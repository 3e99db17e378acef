"""Training, top to bottom: ``train`` checks the input and takes the run dir, ``_train`` prepares the
data and joins the process group, ``loop`` runs the steps.

``loop`` reads as the schedule of one step: run it (``trainer.step``), agree over ranks on its loss
and on stopping, write what ``Cadence`` says is due (metrics, evaluation, checkpoint), and stop at a
step boundary when any rank got a stop signal. Failure drills (``trainer.faults``), throughput
(``Throughput``) and rank 0's output (``Report``) are small pieces of their own. Before the first step
each part of the start-up is named to the launcher (``runtime.starting``): data, rendezvous, setup,
compile.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from filelock import FileLock, Timeout

from gptlaunch import runtime
from gptlaunch.runtime import EXIT_CHECKPOINTED, EXIT_OK
from trainer import checkpoint, distributed, tracking
from trainer.compile_cache import CompileCache
from trainer.config import TrainConfig
from trainer.data.prepare import prepare_data
from trainer.distributed import DistEnv
from trainer.errors import ConfigError, TrainingError
from trainer.faults import FaultInjection
from trainer.metrics import MetricsWriter, Progress, peak_flops
from trainer.optim import lr_at
from trainer.precheck import check_config
from trainer.run import Run, save, setup, snapshot_on_failure, snapshot_state
from trainer.saver import SaveTimes
from trainer.signals import StopRequest
from trainer.step import agree, agree_before_update, backward, evaluate, update
from trainer.stragglers import StragglerWatch, describe

WAIT_NOTED_S = 0.1  # a save that waited this long for the previous one says so


def train(cfg: TrainConfig) -> int:
    """Run training to ``cfg.max_steps``. Returns EXIT_OK, or EXIT_CHECKPOINTED after a stop signal.

    Raises DataError / CheckpointError / ConfigError for bad input and TrainingError when training
    diverges.
    """
    env = distributed.read_env()
    device = distributed.pick_device(cfg.device, env)
    check_config(cfg, world_size=env.world_size)  # bad input fails here, before anything is written
    tracking.check_installed(cfg.mlflow)  # here, not in check_config: the launcher's machine may lack it
    with _run_dir_lock(cfg.run_dir, enabled=env.is_main):
        return _train(cfg, env, device)


@contextlib.contextmanager
def _run_dir_lock(run_dir: Path, enabled: bool) -> Iterator[None]:
    """Rank 0 holds ``run_dir/.run.lock`` for the whole run: two jobs writing checkpoints and metrics
    into one run dir would corrupt both. Raises ConfigError when another run holds it."""
    if not enabled:
        yield
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"--run-dir {run_dir}: cannot create it ({e.strerror}); pass a writable directory"
        ) from None
    lock = FileLock(str(run_dir / ".run.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ConfigError(
            f"--run-dir {run_dir} is in use by another run: wait for it, cancel it, or pass another --run-dir"
        ) from None
    try:
        yield
    finally:
        lock.release()


def _train(cfg: TrainConfig, env: DistEnv, device: torch.device) -> int:
    # First: start-up (data, rendezvous, compile) has its own hang budget. The watch's last beat, at
    # exit, gives the step a failing rank reached (the launcher's retry rule compares it).
    runtime.watch()
    if env.is_main:  # under the run-dir lock: no other run is writing here
        checkpoint.remove_partial_saves(cfg.run_dir)
    # Prepare before joining the process group: a long tokenizer run must not hit rendezvous or
    # collective timeouts, and a file lock (not a barrier) lets one rank prepare while the others wait.
    runtime.starting("data")
    manifest = prepare_data(
        cfg.data_dir,
        cfg.data_source(),
        vocab_size=cfg.vocab_size,
        token_dtype=cfg.token_dtype,
        log=print if env.is_main else (lambda _msg: None),
    )
    backend = distributed.pick_backend(cfg.backend, device)
    runtime.starting("rendezvous")
    distributed.init(env, backend, cfg.dist_timeout_s)
    # One line per rank: which host and device each rank landed on is the first thing to check.
    print(
        f"rank {env.rank}/{env.world_size} (local_rank {env.local_rank}) on {socket.gethostname()}: "
        f"device {device}, backend {backend if env.is_distributed else 'none'}",
        flush=True,
    )
    run: Run | None = None
    try:
        runtime.starting("setup")  # the model, the optimizer, a resume, DDP
        run = setup(cfg, env, device, manifest)
        # The checkpoint's write ends first (a failed one raises), then the snapshots go, once the run
        # ended with its checkpoint.
        compiled = run.compile_cache or contextlib.nullcontext()
        with compiled, run.snapshots, run.saver, StopRequest(cfg.stop_signals) as stop:
            try:
                return loop(run, stop)
            except TrainingError:  # diverged: the weights hold no state worth resuming
                raise
            except Exception:  # a lost peer's failed collective, most often: keep what this rank holds
                runtime.flush()  # the step reached comes first: the write below may be cut short
                with contextlib.suppress(Exception):  # never in the way of the error itself
                    snapshot_on_failure(run)  # while a SIGTERM (torchrun ending the ranks) still waits
                raise
    finally:
        runtime.flush()  # the step reached, before a teardown that may hang
        # The model's DDP reducer holds the process group. Dropped before the group, the group's last
        # reference is Python's, whose destructor lets go of the GIL. Dropped after it, the reducer
        # destroys the group holding the GIL while gloo's worker thread waits for the GIL to free the
        # last collective's tensors: a deadlock at exit (seen in CI; pytorch/pytorch#56297).
        run = None
        distributed.shutdown()


def loop(run: Run, stop: StopRequest) -> int:
    """Train from ``run.start_step`` to ``max_steps``. Collective. Returns EXIT_OK, or EXIT_CHECKPOINTED
    once the checkpoint of a stop signal is saved. Raises TrainingError when the loss diverges."""
    cfg = run.cfg
    cadence = Cadence(cfg, run.start_step)
    compiled = run.compile_cache
    fault = FaultInjection.from_env(run.env)
    stragglers = StragglerWatch(run.device, run.env.world_size, cfg.straggler_check)
    obs = Observers(Throughput(run), stragglers)
    runtime.resumed_from(run.start_step)
    with Report(run) as report:
        report.log(_start_line(run, obs.meter.tokens_per_step))
        runtime.starting("compile" if compiled else "first step", compiled.expected_s() if compiled else None)
        started = time.perf_counter()  # the first step's start: its compile with it
        for step in range(run.start_step, cfg.max_steps):
            fault.check(step)
            t0 = time.perf_counter()
            done = step + 1
            local_loss = backward(run, step, obs.stragglers.clock)
            logs = cadence.logs(done)
            loss, stopping, shared = _agree_and_update(
                run, step, local_loss, stop.requested, obs.stragglers, logs
            )
            obs.step_done(done, time.perf_counter() - t0)
            report.step(done, loss, _record(run, cadence, obs, step, loss, shared))
            if step == run.start_step:
                _after_first_step(report, compiled, time.perf_counter() - started)
            saving = stopping or cadence.checkpoints(done)
            if saving or cadence.snapshots(done):
                report.sync()  # a retry resumes after this step: what it will not redo is logged first
            if saving:  # held only once saved: a retry from this step would skip its checkpoint
                with runtime.phase("checkpoint"):
                    times = save(run, done, stopping, stop.received.name if stop.received else None)
                report.checkpoint(times)
            else:
                # The step's record is out: a retry from here skips none, even if a peer is lost in a
                # snapshot's gather (the survivor's ``keep_last`` stands in for the snapshot).
                run.held.step = done
                if cadence.snapshots(done):
                    with runtime.phase("checkpoint"):
                        snapshot_state(run, done)
            if stopping:
                report.stopped()
                report.log(f"stop signal: checkpoint saved at step {done}; exiting {EXIT_CHECKPOINTED}")
                return EXIT_CHECKPOINTED
            run.held.step = done
    return EXIT_OK


def _agree_and_update(
    run: Run,
    step: int,
    local_loss: torch.Tensor,
    stop_requested: bool,
    stragglers: StragglerWatch,
    logs: bool,
) -> tuple[float, bool, list[float] | None]:
    """``agree`` and ``update``, in the order ``agree_before_update`` says; ``agree``'s result. On a
    step that ``logs``, ``agree`` also shares the straggler check's compute seconds, taken just before
    it: on a GPU after the update's kernels are launched (the clock waits for the device)."""
    early = agree_before_update(run)
    if not early:
        update(run)
    agreed = agree(run, step, local_loss, stop_requested, stragglers.seconds_due(logs))
    if early:
        update(run)
    return agreed


def _after_first_step(report: Report, compiled: CompileCache | None, seconds: float) -> None:
    """All compiled by now: rank 0 keeps the artifacts and the first step's ``seconds`` (its compile
    with it) for the next attempts (``trainer.compile_cache``)."""
    if compiled is not None and (line := compiled.after_first_step(seconds)):
        report.log(line)


def _record(
    run: Run, cadence: Cadence, obs: Observers, step: int, loss: float, shared: list[float] | None
) -> dict[str, Any]:
    """The metrics record after ``step`` (``step + 1`` done): throughput and stragglers (from the
    ranks' ``shared`` compute seconds) when a log line is due, the validation loss when an evaluation
    is (collective then); empty when neither is."""
    done = step + 1
    record: dict[str, Any] = {}
    if cadence.logs(done):
        lr = lr_at(step, run.cfg)
        record = {"step": done, "loss": loss, "lr": lr, **obs.meter.take(), "world_size": run.env.world_size}
        stragglers = obs.stragglers.interval(shared)
        if stragglers:
            record["stragglers"] = stragglers
        if obs.stragglers.last:
            record["rank_tokens_per_s"] = obs.stragglers.rank_tokens_per_s(obs.meter.tokens_per_step)
    if cadence.evaluates(done):
        with runtime.phase("eval"):
            val = evaluate(run)
        record |= {"step": done, "loss": loss, "val_loss": val, "val_ppl": math.exp(min(val, 50.0))}
    return record


@dataclass(frozen=True)
class Observers:
    """What watches each step without changing it: throughput, the straggler check, the launcher's
    heartbeat (``gptlaunch.runtime``)."""

    meter: Throughput
    stragglers: StragglerWatch

    def step_done(self, done: int, step_s: float) -> None:
        self.meter.add(step_s)  # step time only: evaluation and checkpoints excluded
        runtime.beat(done)


@dataclass(frozen=True)
class Cadence:
    """When the loop logs, evaluates and checkpoints, by ``done``: the optimizer steps completed."""

    cfg: TrainConfig
    start_step: int

    def logs(self, done: int) -> bool:
        """Every ``--log-interval`` steps, the last step, and this run's first (a resume shows at once)."""
        return done % self.cfg.log_interval == 0 or done == self.cfg.max_steps or done == self.start_step + 1

    def evaluates(self, done: int) -> bool:
        return done % self.cfg.eval_interval == 0 or done == self.cfg.max_steps

    def checkpoints(self, done: int) -> bool:
        return done % self.cfg.checkpoint_interval == 0 or done == self.cfg.max_steps

    def snapshots(self, done: int) -> bool:
        """Every ``--snapshot-interval`` steps (0: never), where no checkpoint is due."""
        return self.cfg.snapshot_interval > 0 and done % self.cfg.snapshot_interval == 0


class Throughput:
    """Tokens/s over all ranks and MFU, averaged over the steps timed since the last ``take``."""

    def __init__(self, run: Run) -> None:
        self.tokens_per_step = run.batches.plan.global_blocks * run.cfg.block_size
        self._flops_per_token = run.model.flops_per_token()
        # Only rank 0 reports: the others skip measuring the peak (a few seconds of matmuls on a CPU),
        # which rank 0 keeps in the run dir (under its lock) for the next attempts.
        dtype = run.autocast_dtype or torch.float32
        peak = peak_flops(run.cfg.peak_flops, run.device, dtype, run.cfg.run_dir) if run.env.is_main else 1.0
        self._peak_all_ranks = peak * run.env.world_size
        self._seconds, self._steps = 0.0, 0

    def add(self, seconds: float) -> None:
        self._seconds += seconds
        self._steps += 1

    def take(self) -> dict[str, float]:
        """``{"tokens_per_s", "mfu"}`` since the last call; starts a new average."""
        tps = self.tokens_per_step * self._steps / self._seconds
        self._seconds, self._steps = 0.0, 0
        return {"tokens_per_s": tps, "mfu": self._flops_per_token * tps / self._peak_all_ranks}


class Report:
    """Rank 0's output: records to metrics.jsonl and TensorBoard (and MLflow with ``--mlflow``), and
    lines (or a progress bar) on the console. A context manager that closes them, ending the MLflow run
    with how the loop ended; on other ranks it writes nothing."""

    def __init__(self, run: Run) -> None:
        main = run.env.is_main
        self._total = run.cfg.max_steps
        self._writer = MetricsWriter(run.cfg.run_dir, run.start_step) if main else None
        self._tracker = tracking.start(run.cfg) if main else None
        self._stopped = False  # by a stop signal, after its checkpoint
        self._progress = Progress(run.cfg.max_steps, run.start_step, enabled=main)
        self._stragglers: set[int] = set()  # the ranks named on the console, while they stay slow

    def __enter__(self) -> Report:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.close()
        if self._writer is not None:
            self._writer.close()
        if self._tracker is not None:
            self._tracker.close(tracking.status_of(exc, self._stopped))

    def stopped(self) -> None:
        """The loop stops on a stop signal, its checkpoint saved (MLflow: the run KILLED, not FINISHED)."""
        self._stopped = True

    def sync(self) -> None:
        """Before a checkpoint or snapshot: wait (a bounded time) until MLflow has every record logged."""
        if self._tracker is not None:
            self._tracker.sync()

    def log(self, line: str) -> None:
        self._progress.log(line)

    def checkpoint(self, times: SaveTimes | None) -> None:
        """After a save on rank 0: what it cost the loop, to metrics.jsonl, and a line when it had to
        wait for the previous save, still writing (the disk is slower than --checkpoint-interval)."""
        if times is None or self._writer is None:
            return
        self._writer.write(
            {
                "step": times.step,
                "checkpoint_stall_s": times.stall_s,
                "checkpoint_wait_s": times.waited_s,
                "checkpoint_mb": times.nbytes / 1e6,
                "time": time.time(),  # when it was taken: the report's timeline (epoch seconds)
            }
        )
        if times.background and times.waited_s >= WAIT_NOTED_S:  # a stop's or the last save's may wait
            self._progress.log(
                f"checkpoint of step {times.step} waited {times.waited_s:.1f} s for the previous one to be "
                "written: the disk is slower than --checkpoint-interval steps"
            )

    def step(self, done: int, loss: float, record: dict[str, Any]) -> None:
        """After step ``done``: write ``record`` (if any) and its line, and move the progress bar."""
        if record and self._writer is not None:
            self._writer.write(record)
            if self._tracker is not None:
                self._tracker.log(record)
            self._progress.log(_format(record, self._total))
            named = {s["rank"]: s for s in record.get("stragglers", [])}
            for rank in named.keys() - self._stragglers:  # on the console once, when first named
                self._progress.log(describe(named[rank]))
            if "tokens_per_s" in record:  # a log interval's record: the current verdict
                self._stragglers = set(named)
        self._progress.update(done, f"loss {loss:.3f}")


def _start_line(run: Run, tokens_per_step: int) -> str:
    cfg, env = run.cfg, run.env
    return (
        f"training: world_size={env.world_size} device={run.device} precision={cfg.precision} "
        f"params={run.model.num_params() / 1e6:.2f}M tokens/step={tokens_per_step} "
        f"grad_accum={run.batches.plan.grad_accum_steps} steps {run.start_step}->{cfg.max_steps} "
        f"data={run.manifest.source}"
    )


def _format(record: dict[str, Any], total: int) -> str:
    parts = [f"step {record['step']}/{total}"]
    for key, fmt in (
        ("loss", ".4f"),
        ("val_loss", ".4f"),
        ("val_ppl", ".2f"),
        ("lr", ".2e"),
        ("tokens_per_s", ",.0f"),
        ("mfu", ".2%"),
    ):
        if key in record:
            parts.append(f"{key} {record[key]:{fmt}}")
    return " | ".join(parts)
