"""What a training script may cooperate on with the launcher that runs it (the public runtime API).

Run through the launcher (``launcher submit ... -- train.py ARGS``), every rank of a Python program is
already watched with no change to its code (``gptlaunch.shim``): a heartbeat after every optimizer
step, torch's flight recorder, hang stacks. These few calls add what a script must take part in::

    from gptlaunch import runtime

    ckpt_dir = runtime.checkpoint_dir() or Path("out")       # where checkpoints should go
    start = load_checkpoint(ckpt_dir) if runtime.resumed() else 0
    runtime.resumed_from(start)
    for step in range(start, max_steps):
        train_step()                                           # optimizer.step() beats by itself
        if runtime.stop_requested():                           # SIGTERM/SIGUSR2: preemption, cancel
            path = save_checkpoint(ckpt_dir, step + 1)
            runtime.exit_checkpointed(step + 1, path)          # exits 75: resume by submitting again

Under bare ``torchrun`` (no launcher: ``GPTLAUNCH_JOB_ID`` unset) every call is inert: nothing is
installed or written, ``stop_requested()`` is False, ``attempt()`` is 1, ``checkpoint_dir()`` is None,
and ``exit_checkpointed`` only exits 75. It imports no torch.

Programs the launcher starts without the shim (the built-in trainer) call ``watch()`` first.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from gptlaunch.compute import ForwardClock
from gptlaunch.contract import (
    ATTEMPT_ENV,
    EXIT_CHECKPOINTED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    HEARTBEAT_DIR_ENV,
    JOB_ID_ENV,
    RETRIES_ENV,
    RUN_DIR_ENV,
    RUN_ID_ENV,
    SNAPSHOT_ROOT,
    SWEEP_ID_ENV,
    clear_stop_marker,
    job_snapshots,
    write_stop_marker,
)
from gptlaunch.heartbeat import Heartbeat

__all__ = [
    "EXIT_CHECKPOINTED",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "SNAPSHOT_ROOT",
    "attempt",
    "beat",
    "checkpoint_dir",
    "checkpointed",
    "exit_checkpointed",
    "flush",
    "launched",
    "may_retry",
    "phase",
    "resumed",
    "resumed_from",
    "retried",
    "run_id",
    "snapshot_dir",
    "starting",
    "stop_requested",
    "sweep_id",
    "warn",
    "watch",
    "whole_lines",
]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)  # SIGUSR2: SLURM's usual warning before a time limit


class _Rank:
    """This process's place in the job, from torchrun's variables (0 when there are none)."""

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", "0"))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))


_lock = threading.Lock()
_heartbeat: Heartbeat | None = None
_last_beat = 0.0  # time.monotonic() of the last beat: a step's wall time
_manual = False  # the script beats itself: the optimizer-step hook stands down
_warnings: dict[str, str] = {}  # topic -> what ``launcher status`` shows for this rank (``warn``)
_start_told = False  # the script said where it resumed (``resumed_from``)
_clock = ForwardClock()  # this rank's own compute per step, for the straggler check
_watching = False
_stop: signal.Signals | None = None
_handlers_installed = False


def launched() -> bool:
    """Whether a gptlaunch launcher started this process (False under bare torchrun)."""
    return bool(os.environ.get(JOB_ID_ENV))


def attempt() -> int:
    """The job's attempt that started this process: 1, then 2, 3, ... after each retry or requeue
    (SLURM's requeues: its ``SLURM_RESTART_COUNT`` + 1)."""
    if not launched():
        return 1
    if ATTEMPT_ENV in os.environ:
        return int(os.environ[ATTEMPT_ENV])
    return int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1


def resumed() -> bool:
    """Whether this is a later attempt of the job, which should resume from its newest checkpoint."""
    return attempt() > 1


def checkpoint_dir() -> Path | None:
    """The job's run dir, where checkpoints should be written (None under bare torchrun)."""
    value = os.environ.get(RUN_DIR_ENV) if launched() else None
    return Path(value) if value else None


def run_id() -> str | None:
    """The run's id for an experiment tracker (W&B, MLflow): the job's id, the same on every attempt,
    retry and requeue of the job, so that a tracker's run found by it goes on where it stopped. None
    under bare torchrun."""
    return os.environ.get(RUN_ID_ENV) or None


def sweep_id() -> str | None:
    """The id of the sweep this run is one of (``launcher submit --sweep``); None for a single job."""
    return os.environ.get(SWEEP_ID_ENV) or None


def whole_lines() -> None:
    """Make this process's stdout and stderr write each line whole, in one write. Under
    ``PYTHONUNBUFFERED`` (which the launcher sets) ``print`` writes the text and its newline apart,
    and torchrun's tail of a worker's output, which prefixes each line with its rank, can read in
    between: the line then ends with the next line's prefix (``...precision)[rank1]:``), and two
    ranks' same line no longer reads the same. Line buffering keeps each line to one write."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # a replaced stream may not have it
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)


def may_retry() -> bool:
    """Whether another attempt may follow a failure of this one, and resume where it stopped: the
    launcher's ``--retries`` not used up, or torchrun's ``--max-restarts``."""
    if launched():
        return attempt() <= int(os.environ.get(RETRIES_ENV) or 0)
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0


def retried() -> bool:
    """Whether this attempt follows a failed one of the same job: a retry or requeue by the launcher,
    or a restart by torchrun (``--max-restarts``)."""
    return resumed() or int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0


def snapshot_dir(run_dir: Path) -> Path:
    """Where this host keeps in-memory snapshots (``/dev/shm``: host memory, which outlives the ranks'
    processes) of the run in ``run_dir``: one directory per job (the launcher's job id, the same on
    every attempt; under bare torchrun its rendezvous id) and run dir. The launcher removes a job's when
    the job ends for good on the local scheduler; elsewhere the program removes its own."""
    run_id = os.environ.get(JOB_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return job_snapshots(run_id) / key


def stop_requested() -> bool:
    """Whether the job was asked to stop (SIGTERM or SIGUSR2: a cancel, a preemption, a time limit or
    a retry elsewhere). The first call takes those signals over (from the main thread); call it once
    per step, then save a checkpoint and ``exit_checkpointed``. Always False under bare torchrun."""
    global _handlers_installed
    if not launched():
        return False
    if not _handlers_installed and threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _on_stop)
        _handlers_installed = True
    return _stop is not None


def _on_stop(signum: int, frame: FrameType | None) -> None:
    global _stop
    _stop = signal.Signals(signum)


def resumed_from(step: int) -> None:
    """The run resumed at optimizer step ``step`` (from the script's checkpoint): steps are counted on
    from there, and goodput does not count the steps before it as this attempt's. Without it, a program
    whose optimizer keeps a step count (Adam, AdamW: ``state["step"]``, restored from its checkpoint) is
    counted on from that count, read once at its first step."""
    global _start_told
    _start_told = True
    with _lock:
        hb = _beats()
        if hb is not None:
            hb.resumed(step)


def beat(step: int, tokens: int | None = None) -> None:
    """``step`` optimizer steps are done (for loops without a ``torch.optim`` optimizer, whose steps
    beat by themselves); ``tokens``: tokens this rank has processed so far, if known. Cheap: a clock
    read, and a small file write at most twice a second."""
    global _manual
    _manual = True
    _step_done(step, tokens)


def starting(part: str, expect_s: float | None = None) -> None:
    """Before the first step: this rank is now in start-up part ``part`` (e.g. "data", "rendezvous",
    "compile"), until the next part or its first optimizer step; ``expect_s``: the seconds it is
    expected to take, where the program knows (a compile timed before). The console names a part
    that lasts (with ``expect_s``), the first step's line every part with its seconds, and the job's
    report each attempt's; the time before the first part is the launch (processes, imports). Ignored
    after the first step; nothing under bare torchrun."""
    with _lock:
        hb = _beats()
        if hb is not None:
            hb.starting(part, expect_s)


def warn(message: str | None, topic: str = "program") -> None:
    """Print ``message`` as a warning (stderr) and show it for this rank in ``launcher status`` until
    the next call on the same ``topic``; None clears that topic's (e.g. a checkpoint that did not fit,
    once one has been saved again), and leaves the others'. Under bare torchrun: only the print."""
    if message is not None:
        print(f"warning: {message}", file=sys.stderr, flush=True)
    with _lock:
        if message is None:
            _warnings.pop(topic, None)
        else:
            _warnings[topic] = message
        hb = _beats()
        shown = "; ".join(_warnings.values()) or None
        if hb is not None and hb.warning != shown:
            hb.warning = shown
            hb.flush()


def exit_checkpointed(step: int, checkpoint: str | Path) -> NoReturn:
    """After saving the checkpoint of a stop request: ``checkpointed``, then exit 75
    (``EXIT_CHECKPOINTED``: submit again, or let the scheduler requeue, to resume)."""
    checkpointed(step, checkpoint, _stop.name if _stop else None)
    sys.exit(EXIT_CHECKPOINTED)


def checkpointed(step: int, checkpoint: str | Path, signal: str | None = None) -> None:
    """Record that the run stops after saving ``checkpoint`` at ``step`` on a stop request (``signal``:
    its name, e.g. "SIGUSR2"): rank 0 writes the run's stop marker, so the launcher reports the job
    checkpointed rather than failed once the ranks exit 75. For programs that exit by themselves
    (``exit_checkpointed`` does both). Raises OSError when the marker cannot be written."""
    run_dir = checkpoint_dir()
    if run_dir is not None and _Rank().rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_stop_marker(run_dir, step, Path(checkpoint), signal)
    with _lock:
        hb = _beats()
        if hb is not None:
            hb.step = step
            hb.flush()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Within: ``name``, "eval" or "checkpoint", with the hang budget of a phase (``--hang-phase-s``)
    instead of a step's, its forwards not counted as training compute; then steps again.
    Raises ValueError for another name."""
    global _last_beat
    if name not in ("eval", "checkpoint"):
        raise ValueError(f"phase {name!r}: use 'eval' or 'checkpoint'")
    with _lock:
        hb = _beats()
        before = hb.enter(name) if hb is not None else None
        paused, _clock.paused = _clock.paused, True
    try:
        yield
    finally:
        with _lock:
            if hb is not None and before is not None:
                hb.enter(before)
            _clock.paused = paused
            _last_beat = time.monotonic()  # the next step's time leaves this phase out


def _beats() -> Heartbeat | None:
    """This rank's heartbeat, started on first use (None when the launcher does not watch it)."""
    global _heartbeat
    if _heartbeat is None and os.environ.get(HEARTBEAT_DIR_ENV) and launched():
        _heartbeat = Heartbeat.from_env(_Rank(), _clock.mean_s)
    return _heartbeat


def _step_done(step: int | None, tokens: int | None = None) -> None:
    """An optimizer step ended: ``step`` steps are done (None: one more than the last)."""
    global _last_beat
    with _lock:
        hb = _beats()
        if hb is None:
            return
        now = time.monotonic()
        step_s = now - _last_beat if _last_beat else 0.0
        _last_beat = now
        _clock.step_done()
        hb.step_done(hb.step + 1 if step is None else step, step_s, tokens)


def flush() -> None:
    """Write this rank's last beat now, whatever the throttle (it is written at exit too): before a
    teardown that may hang, such as ``destroy_process_group``. Nothing under bare torchrun."""
    _last_beat_out()


def _last_beat_out() -> None:
    """At exit: the step reached, whatever the throttle (``status`` and goodput read it)."""
    with _lock:
        if _heartbeat is not None:
            _heartbeat.flush()


def watch() -> None:
    """Start this rank's watch, once, before the program trains (``gptlaunch.shim`` does it before the
    script runs): its heartbeat and flight recorder (before the process group is made), a beat after
    every optimizer step through torch's global step hook (counting the first optimizer that steps),
    and the forward clock of the straggler check (``gptlaunch.compute``). Nothing under bare torchrun."""
    global _watching
    if _watching or _beats() is None:
        return
    _watching = True
    atexit.register(_last_beat_out)
    run_dir = checkpoint_dir()
    if run_dir is not None and _Rank().rank == 0:
        clear_stop_marker(run_dir)  # a new start: the last stop is history
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:  # not a torch program: it may still beat()
        return
    # The global hook that finds the model is gone after its first call; torch.compile warns once that
    # it sees one (it would fire an extra time for the compiled wrapper: the clock ignores that).
    warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
    _clock.attach()
    counted: list[int] = []

    def after_step(optimizer: Any, args: object, kwargs: object) -> None:
        if not counted:
            counted.append(id(optimizer))
            _first_step(optimizer)
        if not _manual and id(optimizer) == counted[0]:
            _step_done(None)

    register_optimizer_step_post_hook(after_step)


def _first_step(optimizer: Any) -> None:
    """Where a resumed program starts, from its optimizer's own step count (see ``resumed_from``)."""
    steps = next((s["step"] for s in optimizer.state.values() if "step" in s), None)
    count = int(steps) if steps is not None and not _start_told else 0  # int(): one sync on a GPU, once
    if count > 1:
        with _lock:
            hb = _beats()
            if hb is not None:
                hb.resumed(count - 1)
