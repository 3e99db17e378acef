"""A rank's own compute per optimizer step, with no change to its program: the seconds of its model's
forward passes, for the launcher's straggler check (``launcher.job.progress.stragglers``).

One slow rank sets the pace of all: every rank's whole step then takes as long, the fast ones waiting
in the gradient all-reduce. A DDP model's forward holds no collective (the all-reduce runs in
backward; DDP's own forward, which may broadcast buffers, is left out), so its time is the rank's own
speed. Under FSDP, tensor or pipeline parallelism the forward holds collectives too, and the verdict
is diluted accordingly.

``ForwardClock.attach`` finds the model through torch's global module pre-hook: the first module that
is called with gradients on, has a trainable parameter, and is not a ``DistributedDataParallel``
wrapper (DDP's inner module, a compiled module, or a plain one; not a frozen encoder or a data
transform). It then hooks that module alone and removes the global hook, so other modules' calls pay
nothing. The hooks are module-level functions: a copy of the model (``copy.deepcopy``, an EMA) copies
no clock, and its forwards are not counted. Forwards under ``torch.no_grad`` (evaluation), inside a
``torch.compile`` trace or a CUDA graph capture are not timed. On a GPU the forward is timed by CUDA
events on the model's device's current stream, read once they have completed (never a sync); on the
CPU by the clock. Torch is imported only by ``attach``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

# The measure is the mean forward time per step over the steps of the last WINDOW_S seconds, and at
# least the last MIN_STEPS: a verdict on fewer seconds of work would follow the scheduler's noise
# (another process on the core for a moment) rather than the rank's speed. A mean, not a median: a
# rank slowed now and then (a CPU quota that stops it for part of each period, a noisy neighbour)
# loses the time in some steps' forwards and not others, and a median would hide it. The first timed
# step (compilation, lazy initialization, autotuning) is left out.
WINDOW_S = 10.0
MIN_STEPS = 20
MAX_STEPS = 1000  # kept at most: fast steps would fill the window with more than a mean needs
MAX_EVENTS = 1000  # CUDA event pairs of one step at most (a program that never steps keeps no more)

_torch: Any = None  # the torch module, once attached
_clock: ForwardClock | None = None  # the clock the hooks report to
_find_lock = threading.Lock()


class ForwardClock:
    """Forward seconds per optimizer step of the program's model (see the module docstring)."""

    def __init__(self) -> None:
        self.paused = False  # in evaluation or a checkpoint: their forwards are not training compute
        self._global: Any = None  # the global pre-hook's handle until the model is found
        self._target: int | None = None  # id() of the model
        self._device: Any = None  # the model's CUDA device, None on the CPU
        self._depth, self._timing = 0, False
        self._t0, self._seconds = 0.0, 0.0
        self._events: list[tuple[Any, Any]] = []  # this step's (start, end) CUDA events
        self._pending: deque[list[tuple[Any, Any]]] = deque(maxlen=MAX_STEPS)  # events maybe running
        self._done: deque[tuple[float, float]] = deque()  # (time.monotonic(), seconds), MAX_STEPS at most
        self._sum = 0.0  # of the seconds in ``_done``
        self._first = True

    def attach(self) -> None:
        """Start looking for the model. Raises ImportError without torch."""
        global _torch, _clock
        import torch
        from torch.nn.modules.module import register_module_forward_pre_hook

        _torch, _clock = torch, self
        self._global = register_module_forward_pre_hook(_find)

    def step_done(self) -> None:
        """An optimizer step ended: its forwards so far are one step's (none: the step is not counted)."""
        self._depth = 0  # a forward that raised past a caught exception leaves no count behind
        done = [(start, end) for start, end in self._events if end is not None]
        if done:
            self._pending.append(done)
        elif self._seconds:
            self._add(self._seconds)
        self._events, self._seconds = [], 0.0

    def mean_s(self) -> float | None:
        """Mean forward seconds per step over the steps timed in the last WINDOW_S seconds, and at least
        the last MIN_STEPS (None before any)."""
        while self._pending and not _capturing() and all(end.query() for _, end in self._pending[0]):
            self._add(sum(start.elapsed_time(end) for start, end in self._pending.popleft()) / 1e3)
        return self._sum / len(self._done) if self._done else None

    def _add(self, seconds: float) -> None:
        if self._first:
            self._first = False
            return
        now = time.monotonic()
        self._done.append((now, seconds))
        self._sum += seconds
        while len(self._done) > MAX_STEPS or (
            len(self._done) > MIN_STEPS and now - self._done[0][0] > WINDOW_S
        ):
            self._sum -= self._done.popleft()[1]

    def _start(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        self._timing = not self.paused and _torch.is_grad_enabled()
        if not self._timing:
            return
        if self._device is None:
            self._t0 = time.perf_counter()
        elif not _capturing() and len(self._events) < MAX_EVENTS:
            self._events.append((self._event(), None))

    def _end(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth or not self._timing:
            return
        if self._device is None:
            self._seconds += time.perf_counter() - self._t0
        elif self._events and self._events[-1][1] is None and not _capturing():
            self._events[-1] = (self._events[-1][0], self._event())

    def _event(self) -> Any:
        event = _torch.cuda.Event(enable_timing=True)
        event.record(_torch.cuda.current_stream(self._device))
        return event


def _capturing() -> bool:
    return bool(_torch.cuda.is_available() and _torch.cuda.is_current_stream_capturing())


def _find(module: Any, args: object) -> None:
    """The global pre-hook: hooks the model on its first training call, then removes itself."""
    clock = _clock
    if clock is None or clock._global is None or _torch.compiler.is_compiling():
        return
    if isinstance(module, _torch.nn.parallel.DistributedDataParallel) or not _torch.is_grad_enabled():
        return
    if not any(p.requires_grad for p in module.parameters()):
        return
    with _find_lock:  # two threads' first calls: one model
        if clock._global is None:
            return
        clock._global.remove()
        clock._global = None
    param = next(module.parameters())
    clock._target, clock._device = id(module), (param.device if param.device.type == "cuda" else None)
    module.register_forward_pre_hook(_pre)
    module.register_forward_hook(_post, always_call=True)  # also when forward raises
    # This call's own pre-hooks were read before these were added; its post-hooks are read after.
    clock._start()


def _pre(module: Any, args: object) -> None:
    clock = _clock
    if clock is not None and id(module) == clock._target and not _torch.compiler.is_compiling():
        clock._start()


def _post(module: Any, args: object, output: object) -> None:
    clock = _clock
    if clock is not None and id(module) == clock._target and not _torch.compiler.is_compiling():
        clock._end()
