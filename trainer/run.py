"""A training run's working set: built once by ``setup``, resumed from a checkpoint, saved by ``save``.

``setup`` builds the model, optimizer and data of a run, continues the checkpoint it should resume
(checked against this run by ``trainer.checkpoint``), then wraps the model for DDP and compile.
``save`` writes the run's checkpoint. Both are collective: every rank calls them.
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gptlaunch import runtime
from gptlaunch.snapshots import Snapshots
from trainer import checkpoint, distributed, resume
from trainer.compile_cache import CompileCache, cache_path, platform_inputs, run_key
from trainer.config import TrainConfig
from trainer.console import warn
from trainer.data.batches import BatchPlan, TrainBatches
from trainer.data.manifest import Manifest
from trainer.data.splits import open_split
from trainer.distributed import DistEnv
from trainer.errors import ConfigError, DataError
from trainer.isa_probe import remember_isa_probes
from trainer.model import GPT
from trainer.optim import make_optimizer
from trainer.saver import Saver, SaveTimes


@dataclass(frozen=True, kw_only=True)
class Run:
    """What the loop works with, built once by ``setup`` (after any resume and the DDP wrap)."""

    cfg: TrainConfig
    env: DistEnv
    device: torch.device
    manifest: Manifest
    model: GPT  # the plain module: state dicts, evaluation
    step_model: nn.Module  # what the step calls: DDP and/or compiled wrapper of ``model``
    ddp: DDP | None  # ``model`` wrapped for gradient all-reduce; None in a single process
    optimizer: torch.optim.AdamW
    scaler: torch.amp.GradScaler | None  # fp16 loss scaling; None for bf16 and fp32
    autocast_dtype: torch.dtype | None  # None: fp32, no autocast
    batches: TrainBatches
    val_tokens: np.memmap  # the validation split, (num_tokens,) token ids
    start_step: int  # the first step this run takes: 0, or the resumed checkpoint's step
    saver: Saver  # writes rank 0's checkpoints (in the background); a context manager
    compile_cache: CompileCache | None  # torch.compile's artifacts in the run dir; None: not compiled
    snapshots: Snapshots  # the run's snapshots in the hosts' memory (``gptlaunch.snapshots``)
    held: Held  # what a snapshot on a failure needs (``snapshot_on_failure``)


@dataclass
class Held:
    """What this rank knows of the training state between collectives: ``step``, the optimizer steps
    the weights hold once all of that step's work has ended (its metrics, evaluation, checkpoint; a
    snapshot excepted, which keeping the step stands in for); None from the next update until then,
    since a retry from a step whose work did not end would skip it (a missing record, checkpoint, or
    the last step's save). ``rng``:
    every rank's CPU RNG state in rank order as last gathered (empty before the first gather)."""

    step: int | None
    rng: list[torch.Tensor] = field(default_factory=list)


def check_same_tokenizer(manifest: Manifest) -> list[str]:
    """Every rank encodes with the same tokenizer. Nodes whose run dirs no other node sees (hosts that
    share no file system) each prepare their own data: text that differs between them, or another
    ``tokenizers`` version, would make ranks train on different token ids without an error. Collective.
    Returns every rank's host, in rank order. Raises DataError naming each rank's host and tokenizer
    sha256, and the fix."""
    mine = (socket.gethostname(), manifest.tokenizer_sha256)
    found = distributed.all_gather_object(mine)
    if len({sha for _, sha in found}) > 1:
        ranks = "; ".join(f"rank {r} on {host}: {sha[:12]}" for r, (host, sha) in enumerate(found))
        raise DataError(
            f"the ranks' tokenizers differ ({ranks}): each node prepared its data from its own copy of the "
            "text; fix: give every node the same text (and the same tokenizers version), or a --data-dir "
            "that all nodes share"
        )
    return [host for host, _ in found]


def setup(cfg: TrainConfig, env: DistEnv, device: torch.device, manifest: Manifest) -> Run:
    """Build the model, optimizer and data, resume from a checkpoint if there is one, then wrap the
    model (DDP, compile). Collective. Raises CheckpointError / ConfigError for unusable input, DataError
    when the ranks' tokenizers differ (``check_same_tokenizer``)."""
    hosts = check_same_tokenizer(manifest)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(cfg.gpt_config(manifest.vocab_size)).to(device)
    optimizer = make_optimizer(model, cfg, device)
    autocast_dtype, needs_scaler = _precision(cfg, device)
    scaler = torch.amp.GradScaler(device.type) if needs_scaler else None
    batches, val_tokens = _open_data(cfg, env)
    # Kept by the lowest rank of each host when another attempt may follow; hosts already gathered.
    snapshots = Snapshots(cfg.run_dir, cfg.snapshot_interval, device, hosts)
    state = _checkpoint_to_resume(cfg, env, manifest, batches, model, snapshots)
    if state is not None:
        checkpoint.restore(state, model, optimizer, scaler)
    _seed_rank_stream(cfg, env, device, state)
    ddp = _wrap_ddp(model, env, device)
    step_model: nn.Module = model if ddp is None else ddp
    start_step = 0 if state is None else checkpoint.saved_step(state)
    compile_cache = None
    if cfg.compile:
        compile_cache = _compile_cache(cfg, env, device, model, autocast_dtype)
        compile_cache.load()  # before the first compiled call: a retry's compile hits what it fills
        # Compiled after the DDP wrap: with the DDPOptimizer, DDP's buckets split the graph.
        torch._dynamo.config.optimize_ddp = cfg.resolved_ddp_optimizer(device.type)
        step_model = torch.compile(step_model, mode=cfg.resolved_compile_mode(device.type))  # type: ignore[assignment]
    return Run(
        cfg=cfg,
        env=env,
        device=device,
        manifest=manifest,
        model=model,
        step_model=step_model,
        ddp=ddp,
        optimizer=optimizer,
        scaler=scaler,
        autocast_dtype=autocast_dtype,
        batches=batches,
        val_tokens=val_tokens,
        start_step=start_step,
        saver=Saver(cfg.run_dir, cfg.keep_checkpoints, device),
        compile_cache=compile_cache,
        snapshots=snapshots,
        held=Held(start_step),
    )


def _compile_cache(
    cfg: TrainConfig, env: DistEnv, device: torch.device, model: GPT, dtype: torch.dtype | None
) -> CompileCache:
    """This run's compile artifacts in the run dir, by what its compiled graphs depend on."""
    if device.type == "cpu":
        remember_isa_probes()  # before the key's ISA: 0.8 s of a CPU rank's start, once per host
    key = run_key(
        cfg,
        platform_inputs(device),
        model_shape=asdict(model.cfg),
        autocast_dtype=dtype,
        world_size=env.world_size,
    )
    return CompileCache(cache_path(cfg.run_dir, key), is_main=env.is_main, kernels=device.type == "cpu")


def _precision(cfg: TrainConfig, device: torch.device) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype or None for fp32, whether a GradScaler is needed)."""
    if cfg.precision == "fp32":
        return None, False
    if device.type == "cpu":
        if _cpu_has_fast_bf16():
            if cfg.precision == "fp16":  # oneDNN's fast half type is bf16: no fp16 kernels, no scaling
                warn("--precision fp16 runs in bf16 on this CPU (its native half precision)")
            return torch.bfloat16, False
        # Without native bf16 (AVX512-BF16/AMX; e.g. an AVX2-only CPU) oneDNN runs bf16 and fp16
        # matmuls on a reference path, ~200x slower than fp32 (measured: 2048² matmul 60 s vs 0.3 s).
        warn(f"this CPU has no native bf16 or fp16: --precision {cfg.precision} runs in fp32")
        return None, False
    # including_emulation=False: a GPU that only emulates bf16 (V100, T4) is slow at it; use fp16.
    if cfg.precision == "bf16" and torch.cuda.is_bf16_supported(False):
        return torch.bfloat16, False
    return torch.float16, True  # fp16 asked for, or a GPU without bf16: loss scaling keeps grads alive


def _cpu_has_fast_bf16() -> bool:
    """Whether oneDNN has native bf16 kernels on this CPU (AVX512-BF16, AMX or AVX-NE-CONVERT)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def _open_data(cfg: TrainConfig, env: DistEnv) -> tuple[TrainBatches, np.memmap]:
    """This rank's training batches and the validation split. Raises ConfigError when a split is
    too small for one step (train) or one block (validation)."""
    plan = BatchPlan(cfg.micro_batch_size, cfg.grad_accum_steps(env.world_size), env.world_size)
    batches = TrainBatches(open_split(cfg.data_dir, "train"), cfg.block_size, plan, cfg.seed)
    val_tokens = open_split(cfg.data_dir, "val")
    if len(val_tokens) <= cfg.block_size:
        raise ConfigError(
            f"the validation split has {len(val_tokens)} tokens, fewer than one block of "
            f"{cfg.block_size}: use more text or a smaller --block-size"
        )
    return batches, val_tokens


def _checkpoint_to_resume(
    cfg: TrainConfig,
    env: DistEnv,
    manifest: Manifest,
    batches: TrainBatches,
    model: GPT,
    snapshots: Snapshots,
) -> dict[str, Any] | None:
    """The checkpoint this run continues (loaded, checked against this run), or None: on a retry, a
    host's snapshot in memory when it is newer than the newest whole checkpoint on disk. Collective.

    Raises CheckpointError when it cannot continue this run (see ``checkpoint.check_resumable``), or
    --resume names a damaged file (``resume.first_whole``).
    """
    # Rank 0 lists the checkpoints and tells the others: ranks that saw different files would run
    # different steps. A snapshot newer than the newest checkpoint spares reading that checkpoint.
    found = resume.candidates(cfg.run_dir, cfg.resume, env)
    memory = _newer_snapshot(cfg, snapshots, found[0] if found else None)
    path = None
    if memory is None and found:
        path = resume.first_whole(found, explicit=cfg.resume != "auto", env=env)
        if path != found[0]:  # the newest was damaged: a snapshot older than it may now be the newest
            memory = _newer_snapshot(cfg, snapshots, path)
    if memory is not None:
        state, where = memory
    elif path is not None:
        state, where = checkpoint.load(path, examined=True), str(path)
    else:
        return None
    notes = checkpoint.check_resumable(
        state,
        where,
        cfg=cfg,
        world_size=env.world_size,
        steps_per_epoch=batches.steps_per_epoch,
        model_shape=asdict(model.cfg),
        tokenizer_sha256=manifest.tokenizer_sha256,
    )
    if env.is_main:
        for note in notes:
            print(f"note: {note}", flush=True)
        print(f"resumed from {where} at step {checkpoint.saved_step(state)}", flush=True)
    return state


def _newer_snapshot(
    cfg: TrainConfig, snapshots: Snapshots, path: Path | None
) -> tuple[dict[str, Any], str] | None:
    """On a retry of ``--resume auto``, a host's snapshot in memory when newer than the checkpoint
    ``path`` (None: than none), with where it is in words; None otherwise. Collective."""
    if cfg.resume != "auto":
        return None
    return snapshots.resume(newer_than=checkpoint.step_of(path) if path is not None else None)


def _seed_rank_stream(
    cfg: TrainConfig, env: DistEnv, device: torch.device, state: dict[str, Any] | None
) -> None:
    """Each rank's random stream (dropout): fresh, or the saved one when resuming at the same world
    size, which continues every rank's stream exactly; at another world size, re-seeded by step."""
    if state is None:
        torch.manual_seed(cfg.seed + 1 + env.rank)
        return
    cpu_rng, cuda_rng = checkpoint.saved_rng(state, env.rank, env.world_size)
    if cpu_rng is None:
        torch.manual_seed(cfg.seed + 1 + env.rank + checkpoint.saved_step(state))
        return
    torch.set_rng_state(cpu_rng)
    if device.type == "cuda" and cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, device)


def _wrap_ddp(model: GPT, env: DistEnv, device: torch.device) -> DDP | None:
    if not env.is_distributed:
        return None
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=False,  # every parameter gets a gradient: no graph walk per step
        gradient_as_bucket_view=True,  # grads live in the all-reduce buckets: no copy in or out
    )


def _gather_rng(run: Run) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's RNG states, in rank order (collective: all ranks must call)."""

    def gather(state: torch.Tensor) -> list[torch.Tensor]:
        comm_device = run.device if run.device.type == "cuda" else torch.device("cpu")
        return [s.cpu() for s in distributed.all_gather_tensors(state.to(comm_device))]

    cuda = gather(torch.cuda.get_rng_state(run.device)) if run.device.type == "cuda" else []
    run.held.rng = gather(torch.get_rng_state())
    return run.held.rng, cuda


def _state(run: Run, next_step: int, rng: list[torch.Tensor], cuda_rng: list[torch.Tensor]) -> dict[str, Any]:
    return checkpoint.make_state(
        next_step,
        model=run.model,
        optimizer=run.optimizer,
        scaler=run.scaler,
        rng=rng,
        cuda_rng=cuda_rng,
        cfg=run.cfg,
        world_size=run.env.world_size,
        steps_per_epoch=run.batches.steps_per_epoch,
        model_shape=asdict(run.model.cfg),
        tokenizer_sha256=run.manifest.tokenizer_sha256,
    )


def snapshot_state(run: Run, next_step: int) -> None:
    """Collective: every rank contributes its RNG state; the lowest rank of each host keeps the
    snapshot in the host's memory, written in the background (``gptlaunch.snapshots``). Nothing, not
    even the gather, when no retry may follow (the same on every rank: the job's environment)."""
    if not runtime.may_retry():
        return
    rng, cuda_rng = _gather_rng(run)
    if run.snapshots.writer:
        run.snapshots.keep(next_step, _state(run, next_step, rng, cuda_rng))


def snapshot_on_failure(run: Run) -> None:
    """After an error, on this host's snapshot keeper: keep the state the weights hold in the host's
    memory at once, with no collective (a peer may be gone), so that a retry redoes no step where a
    survivor saw the failure (``Snapshots.keep_last``), when ``known_state`` says it can. Only on the
    CPU: on a GPU a failed collective may leave the device's streams stuck (NCCL), and a copy behind
    them would hang the exit."""
    held = run.held
    keeper = run.snapshots.writer and run.device.type == "cpu"
    if not (keeper and known_state(held, run.env.rank, run.start_step)):
        return
    # An update that made the weights inf or NaN shows only in the next step's loss: never keep one.
    finite = all(bool(p.isfinite().all()) for p in run.model.parameters())
    assert held.step is not None
    if finite and run.snapshots.keep_last(held.step, _state(run, held.step, held.rng, [])):
        print(f"kept step {held.step}'s state in this host's memory for a retry", flush=True)


def known_state(held: Held, rank: int, start_step: int) -> bool:
    """Whether ``held`` is a whole state newer than ``start_step``: a step whose work ended, and every
    rank's RNG state known, which it is when this rank's has not moved since the last gather (no dropout:
    every rank draws alike, so neither have the others')."""
    return (
        held.step is not None
        and held.step > start_step
        and len(held.rng) > rank
        and torch.equal(held.rng[rank], torch.get_rng_state())
    )


def save(run: Run, next_step: int, stopping: bool = False, signal: str | None = None) -> SaveTimes | None:
    """Collective: every rank contributes its RNG state; global rank 0 saves, in the background
    (``trainer.saver``) unless ``stopping``, at the last step, or with ``--no-async-checkpoints``.
    ``stopping``: also record the stop marker (with ``signal``, the stop signal's name as rank 0 got
    it) once the checkpoint is on disk, before the barrier, so it exists once any rank has exited 75.
    Returns rank 0's ``SaveTimes`` (None on the other ranks). Raises NoSpaceError on rank 0 when the
    run's last save (a stop's, the last step's) does not fit on the run dir's file system."""
    rng, cuda_rng = _gather_rng(run)
    last = stopping or next_step == run.cfg.max_steps
    blocking = last or not run.cfg.async_checkpoints
    times = None
    if run.env.is_main:
        state = _state(run, next_step, rng, cuda_rng)
        times = run.saver.save(state, next_step, blocking=blocking, last=last)
        if stopping and times is not None:  # for the launcher (``runtime``): checkpointed, not failed
            runtime.checkpointed(next_step, times.path, signal)
    if blocking:
        distributed.barrier()  # nobody exits or moves on before the files are in place
    return times
