"""torch.compile's work travels with the job: its portable cache artifacts kept in the run dir.

A retry on a host that never compiled this model (a spare, a new node) would otherwise compile it
afresh before its first step. So once the first optimizer step has run compiled, global rank 0 saves
what Inductor and AOTAutograd made of it (``torch.compiler.save_cache_artifacts``: the compiled graphs,
autotuning results and, on a GPU, the Triton kernels bundled into them) to
``RUN_DIR/compile-cache/<key>.bin``, written atomically with its sha256 (``atomic_write_checked``), once
per key: an attempt that loaded that file and compiled nothing more does not write it again. Every
rank of a later attempt loads it before its first compiled call (``torch.compiler.load_cache_artifacts``:
each process fills its own local Inductor cache from it), and its compile then hits that cache instead
of lowering and autotuning again.

``<key>`` hashes what makes the artifacts useless when it changes (``key_inputs``): torch's version, the
device (a GPU's name, compute capability and CUDA version; a CPU's vector ISA, which Inductor's C++ code
is generated for, and its thread count, which Inductor's graph key holds), the model's shape, the
compile mode, the autocast dtype, the micro-batch size (the inputs' shape: Dynamo specializes on it) and
whether DDP wraps the model (its optimizer splits the graph at bucket boundaries; the world size
itself is not in the graphs, see ``key_inputs``). Inductor checks keys of its own on every lookup
too, so an artifact of other graphs merely misses; but its keys leave out a CPU's vector ISA (torch
2.13), hence the ISA here: C++ generated for a host with AMX must not be loaded on one without it.

On a CPU the artifacts spare Inductor's lowering and max-autotune's benchmarks, not the C++ compiler's
builds of the kernels they name (torch keeps no portable copy of those): ``<key>.kernels.tar`` carries
them (``trainer.compile_kernels``).

Beside the artifacts, ``<key>.json`` keeps how long the first step took (compile included) the last
time it ran with the artifacts loaded and without: what a next start says it expects of its compile
(``gptlaunch.runtime.starting``).

Node-local run dirs travel as a whole: the launcher copies everything but hidden and ``*.tmp`` files
(``launcher.agent.copies.snapshot``) to its own machine and on to a next attempt's hosts, so
``compile-cache/`` reaches a spare with the checkpoint, with no work of its own (the write's temporary
file is hidden, and never copied half-written).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from gptlaunch.files import DigestError, atomic_write_checked, atomic_write_text, check_digest
from trainer import compile_kernels
from trainer.config import TrainConfig
from trainer.console import warn

CACHE_DIR = "compile-cache"  # below the run dir
KEY_CHARS = 16  # hex digits of the key's sha256: 64 bits, no collision among a run's few keys


def platform_inputs(device: torch.device) -> dict[str, Any]:
    """What the artifacts depend on in this process and its device: torch's version and the device's
    kind; on a GPU its name (Inductor's own cache key holds it), compute capability and CUDA version;
    on a CPU the vector ISA Inductor generates C++ for and the threads its kernels are built for."""
    found: dict[str, Any] = {"torch": torch.__version__, "device_type": device.type}
    if device.type == "cuda":
        found |= {
            "gpu": torch.cuda.get_device_name(device),
            "capability": list(torch.cuda.get_device_capability(device)),
            "cuda": torch.version.cuda,
        }
    elif device.type == "cpu":
        # Importing Inductor's ISA probe costs what compiling would import anyway.
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        found |= {"isa": str(pick_vec_isa()), "threads": torch.get_num_threads()}
    return found


def key_inputs(
    platform: Mapping[str, Any],
    *,
    model_shape: Mapping[str, Any],
    compile_mode: str,
    autocast_dtype: torch.dtype | None,
    micro_batch_size: int,
    world_size: int,
    ddp_optimizer: bool = False,
) -> dict[str, Any]:
    """Everything that changes the compiled graphs, as plain JSON values. ``platform``: see
    ``platform_inputs``; ``model_shape``: the GPTConfig as a dict; ``autocast_dtype``: the resolved
    precision (None: fp32), not the flag, since ``--precision fp16`` runs bf16 on a CPU.

    The world size enters only as whether DDP wraps the model, and ``ddp_optimizer`` only then: DDP's
    optimizer splits the graph by gradient bucket, whose bounds come from the parameters' sizes and
    DDP's bucket cap, not from the number of ranks, and the collectives run outside the compiled
    graphs. Checked: the artifacts of a 2-rank run (4 Inductor graphs) were 4 hits and no miss in a
    3-rank run on a fresh Inductor cache."""
    return {
        "platform": dict(platform),
        "model_shape": dict(model_shape),
        "compile_mode": compile_mode,
        "autocast": str(autocast_dtype) if autocast_dtype is not None else "fp32",
        "micro_batch_size": micro_batch_size,
        "ddp": ("split" if ddp_optimizer else "whole") if world_size > 1 else False,
    }


def cache_key(inputs: Mapping[str, Any]) -> str:
    """A short hash of ``inputs`` (``key_inputs``): the same for equal inputs, whatever their order."""
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]


def run_key(
    cfg: TrainConfig,
    platform: Mapping[str, Any],
    *,
    model_shape: Mapping[str, Any],
    autocast_dtype: torch.dtype | None,
    world_size: int,
) -> str:
    """The key of a run of ``cfg`` on ``platform`` (``platform_inputs``): its compile mode on that
    device and its micro-batch size from ``cfg``, the rest as for ``key_inputs``. Nothing else of
    ``cfg`` (learning rate, steps, seed, intervals, gradient accumulation) reaches the compiled graphs."""
    inputs = key_inputs(
        platform,
        model_shape=model_shape,
        compile_mode=cfg.resolved_compile_mode(platform["device_type"]),
        autocast_dtype=autocast_dtype,
        micro_batch_size=cfg.micro_batch_size,
        world_size=world_size,
        ddp_optimizer=cfg.resolved_ddp_optimizer(platform["device_type"]),
    )
    return cache_key(inputs)


def cache_path(run_dir: Path, key: str) -> Path:
    return run_dir / CACHE_DIR / f"{key}.bin"


def _describe(artifacts: Mapping[str, list[str]]) -> str:
    """``inductor 2, aot_autograd 1``: how many artifacts of each kind (a CacheInfo's ``artifacts``)."""
    return ", ".join(f"{kind} {len(keys)}" for kind, keys in sorted(artifacts.items()) if keys) or "none"


def cache_counters() -> dict[str, int]:
    """This process's Inductor and AOTAutograd cache hits and misses so far (torch's own counters)."""
    from torch._dynamo.utils import counters

    return {
        name: int(counters[group][name])
        for group, names in (
            ("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
            ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss")),
        )
        for name in names
    }


class CompileCache:
    """One run's compile artifacts at ``path`` (``cache_path``): ``load`` before the first compiled
    call, ``after_first_step`` once it ran; global rank 0 (``is_main``) prints and writes, the others
    only load. ``kernels``: the C++ kernel builds travel too (a CPU's; ``trainer.compile_kernels``).
    A context manager: leaving it waits for the write in flight (a few ms)."""

    def __init__(self, path: Path, *, is_main: bool, kernels: bool = False) -> None:
        self.path, self.is_main, self.kernels = path, is_main, kernels
        self.loaded = False  # whether this process's caches were filled from ``path``
        self._pool: ThreadPoolExecutor | None = None
        self._writing: Future[float] | None = None
        self._found: set[Path] = set()  # the kernel builds there were before this process compiled
        self._root: Path | None = None  # Inductor's cache dir (``kernels``), resolved by ``load``

    @property
    def kernels_path(self) -> Path:
        return self.path.with_suffix(".kernels.tar")

    def load(self) -> bool:
        """Fill this process's Inductor caches from the file, if there is one whose checksum matches.
        Rank 0 says which it was; a missing file is no warning, a damaged or unreadable one is one.
        Never raises: the artifacts only save time. Returns whether they were loaded."""
        if self.kernels:  # what this process builds from here on is what it will keep (``_write``)
            with contextlib.suppress(OSError):
                self._root = compile_kernels.inductor_cache_dir()
                self._found = compile_kernels.builds(self._root)
        if self.is_main:  # under the run-dir lock: a write killed midway left its temporary file
            with contextlib.suppress(OSError):
                for partial in self.path.parent.glob(".*.tmp"):
                    partial.unlink(missing_ok=True)
        if not self.path.exists():
            self._say("compile: no cached artifacts: compiling (the next attempt will load them)")
            return False
        try:
            if not check_digest(self.path):
                raise DigestError("it has no checksum file next to it")
            started = time.perf_counter()
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
            if info is None:  # torch logged why (another torch's format, a truncated record)
                raise DigestError("torch could not read its artifacts")
        # A cache is never worth a failed start: whatever torch's loader raises (a cache dir that
        # cannot be written, an artifact kind this torch lacks) is one line and a normal compile.
        except Exception as e:
            if self.is_main:
                warn(f"compile: skipped the cached artifacts in {self.path}: {e}; compiling")
            return False
        self.loaded = True
        builds = self._load_kernels()
        took = time.perf_counter() - started
        self._say(
            f"compile: loaded cached artifacts ({_describe(info.artifacts)}{builds}) from {self.path} "
            f"in {took:.1f} s"
        )
        return True

    def _load_kernels(self) -> str:
        """Write the kernel builds this host lacks into its Inductor cache dir; ``, N kernel builds``
        for ``load``'s line ("" when there are none to load). Never raises: g++ builds what is missing."""
        if self._root is None:
            return ""
        written = None
        try:
            if self.kernels_path.exists() and check_digest(self.kernels_path):
                written = compile_kernels.unpack(self.kernels_path.read_bytes(), self._root)
        except Exception as e:  # as for the artifacts: never worth a failed start
            if self.is_main:
                warn(f"compile: skipped the kernel builds in {self.kernels_path}: {e}; building them")
        return "" if written is None else f", {written} kernel build(s) new here"

    @property
    def _times_path(self) -> Path:
        return self.path.with_suffix(".json")

    @property
    def _state(self) -> str:
        return "loaded" if self.loaded else "compiled"

    def expected_s(self) -> float | None:
        """The seconds the first step took (compile included) the last time it ran as this one will,
        with the artifacts loaded or without (``load`` first); None when unknown."""
        try:
            value = json.loads(self._times_path.read_text()).get(self._state)
        except (OSError, ValueError, AttributeError):
            return None
        return float(value) if isinstance(value, int | float) and value > 0 else None

    def _keep_time(self, first_step_s: float) -> None:
        """Keep ``first_step_s`` as this state's (best effort: the next start only says less)."""
        try:
            times = json.loads(self._times_path.read_text())
        except (OSError, ValueError):
            times = {}
        times = times if isinstance(times, dict) else {}
        with contextlib.suppress(OSError):
            self._times_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self._times_path, json.dumps(times | {self._state: round(first_step_s, 2)}))

    def after_first_step(self, first_step_s: float) -> str | None:
        """On rank 0, once the first optimizer step ran compiled (``first_step_s`` seconds, compile
        included): keep its time (``expected_s``), say the cache's hits and misses, and start writing
        the artifacts to the file in the background, unless they were loaded from it and nothing
        missed (a load that missed, say after a change the key does not hold, is rewritten). Returns
        the line to print (None on the other ranks). The write's failure is only a warning (``close``)."""
        if not self.is_main:
            return None
        self._keep_time(first_step_s)
        counts = cache_counters()
        line = (
            f"compile: Inductor cache: {counts['fxgraph_cache_hit']} hit(s), "
            f"{counts['fxgraph_cache_miss']} miss(es); AOTAutograd cache: {counts['autograd_cache_hit']} "
            f"hit(s), {counts['autograd_cache_miss']} miss(es)"
        )
        missed = counts["fxgraph_cache_miss"] + counts["autograd_cache_miss"]
        if self.loaded and not missed and (not self.kernels or self.kernels_path.exists()):
            return line  # the files hold all this attempt needed (a hit records its artifact too)
        started = time.perf_counter()
        saved = torch.compiler.save_cache_artifacts()  # bytes already in memory: about a millisecond
        if saved is None:  # no caching compiler ran (caches turned off by TORCHINDUCTOR_* variables)
            return line
        data, info = saved
        took_ms = (time.perf_counter() - started) * 1000
        # The write (an fsync, twice) goes on a thread: a GPU model's artifacts, Triton kernels
        # included, may take tens of MB, which a slow or networked run dir takes a while to sync.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-cache")
        self._writing = self._pool.submit(self._write, data)
        return (
            f"{line}; saving the artifacts ({_describe(info.artifacts)}: {len(data) / 1e6:.1f} MB, "
            f"serialized in {took_ms:.1f} ms) to {self.path}"
        )

    def _write(self, data: bytes) -> float:
        """The artifacts, then (``kernels``) every kernel build this process made or loaded: seconds."""
        took = write_artifacts(self.path, data)
        if self._root is not None:
            root = self._root
            files = (compile_kernels.builds(root) - self._found) | compile_kernels.mapped(root)
            took += write_artifacts(self.kernels_path, compile_kernels.pack(root, files))
        return took

    def close(self) -> float | None:
        """Wait for the write in flight and say how long it took on rank 0; returns its seconds, or None
        when there was none or it failed (one warning: the next attempt compiles and tries again)."""
        if self._writing is None or self._pool is None:
            return None
        try:
            took = self._writing.result()
        except OSError as e:
            warn(f"compile: could not save the artifacts to {self.path}: {e}")
            return None
        finally:
            self._pool.shutdown()
            self._writing = self._pool = None
        self._say(f"compile: saved the artifacts to {self.path} (written in {took * 1000:.0f} ms)")
        return took

    def __enter__(self) -> CompileCache:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _say(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)


def write_artifacts(path: Path, data: bytes) -> float:
    """Write ``data`` to ``path`` atomically, its sha256 beside it. Returns the seconds it took.
    Raises OSError when it cannot be written (a full disk)."""
    started = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write_checked(path) as f:
        f.write(data)
    return time.perf_counter() - started
