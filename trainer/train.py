"""The DDP training loop.

One optimizer step: ``grad_accum_steps`` micro-steps per rank, gradients all-reduced by DDP only on
the last (``no_sync`` covers forward *and* backward of the others, since DDP arms its reducer in
forward), then clipping, AdamW and one small all-reduce that carries the step's mean loss over ranks
and whether any rank was asked to stop, so every rank stops at the same step boundary.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock, Timeout
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import checkpoint, distributed
from trainer.batches import BatchPlan, TrainBatches, blocks_to_batch, eval_block_ids
from trainer.config import ConfigError, TrainConfig
from trainer.contract import EXIT_CHECKPOINTED, EXIT_OK, FAULT_ENV, clear_stop_marker, write_stop_marker
from trainer.data import open_split
from trainer.distributed import DistEnv
from trainer.manifest import Manifest
from trainer.metrics import MetricsWriter, Progress, peak_flops
from trainer.model import GPT
from trainer.optim import lr_at, make_optimizer
from trainer.precheck import check_config
from trainer.prepare import prepare_data
from trainer.signals import StopRequest


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. a non-finite loss); the message says what to change."""


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


def train(cfg: TrainConfig) -> int:
    """Run training to ``cfg.max_steps``. Returns EXIT_OK, or EXIT_CHECKPOINTED after a stop signal.

    Raises DataError / CheckpointError / ConfigError for bad input and TrainingError when training
    diverges.
    """
    env = distributed.read_env()
    device = distributed.pick_device(cfg.device, env)
    check_config(cfg, world_size=env.world_size)  # bad input fails here, before anything is written
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
    if env.is_main:  # under the run-dir lock: no other run is writing here
        clear_stop_marker(cfg.run_dir)  # a new run: the last stop is history
        checkpoint.remove_partial_saves(cfg.run_dir)
    # Prepare before joining the process group: a long tokenizer run must not hit rendezvous or
    # collective timeouts, and a file lock (not a barrier) lets one rank prepare while the others wait.
    manifest = prepare_data(
        cfg.data_dir,
        cfg.data_source(),
        vocab_size=cfg.vocab_size,
        token_dtype=cfg.token_dtype,
        log=print if env.is_main else (lambda _msg: None),
    )
    backend = distributed.pick_backend(cfg.backend, device)
    distributed.init(env, backend, cfg.dist_timeout_s)
    # One line per rank: which host and device each rank landed on is the first thing to check.
    print(
        f"rank {env.rank}/{env.world_size} (local_rank {env.local_rank}) on {socket.gethostname()}: "
        f"device {device}, backend {backend if env.is_distributed else 'none'}",
        flush=True,
    )
    try:
        run = setup(cfg, env, device, manifest)
        with StopRequest(cfg.stop_signals) as stop:
            return loop(run, stop)
    finally:
        distributed.shutdown()


def _precision(cfg: TrainConfig, device: torch.device) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype or None for fp32, whether a GradScaler is needed)."""
    if cfg.precision == "fp32":
        return None, False
    if device.type == "cpu":
        if _cpu_has_fast_bf16():
            return torch.bfloat16, False
        # Without native bf16 (AVX512-BF16/AMX; e.g. an AVX2-only CPU) oneDNN runs bf16 and fp16
        # matmuls on a reference path, ~200x slower than fp32 (measured: 2048² matmul 60 s vs 0.3 s).
        print(f"trainer: this CPU has no native bf16 or fp16: --precision {cfg.precision} runs in fp32")
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


def setup(cfg: TrainConfig, env: DistEnv, device: torch.device, manifest: Manifest) -> Run:
    """Build the model, optimizer and data, resume from a checkpoint if there is one, then wrap the
    model (DDP, compile). Collective. Raises CheckpointError / ConfigError for unusable input."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(cfg.gpt_config(manifest.vocab_size)).to(device)
    optimizer = make_optimizer(model, cfg, device)
    autocast_dtype, needs_scaler = _precision(cfg, device)
    scaler = torch.amp.GradScaler(device.type) if needs_scaler else None
    batches, val_tokens = _open_data(cfg, env)
    state = _checkpoint_to_resume(cfg, env, manifest, batches, model)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
    start_step = 0 if state is None else int(state["step"])
    _seed_rank_stream(cfg, env, device, state)
    ddp = _wrap_ddp(model, env, device)
    step_model: nn.Module = model if ddp is None else ddp
    if cfg.compile:
        # Compile after the DDP wrap so DDP's bucketing splits the graph (DDPOptimizer).
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
    )


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
    cfg: TrainConfig, env: DistEnv, manifest: Manifest, batches: TrainBatches, model: GPT
) -> dict[str, Any] | None:
    """The checkpoint this run continues (loaded, checked against this run), or None. Collective.

    Raises CheckpointError when it cannot continue this run (see ``checkpoint.check_resumable``).
    """
    # Rank 0 decides and tells the others: ranks that saw different files would run different steps.
    found = checkpoint.find_resume(cfg.run_dir, cfg.resume) if env.is_main else None
    path = distributed.broadcast_object(found)
    if path is None:
        return None
    state = checkpoint.load(path)
    notes = checkpoint.check_resumable(
        state,
        path,
        cfg=cfg,
        world_size=env.world_size,
        steps_per_epoch=batches.steps_per_epoch,
        model_shape=asdict(model.cfg),
        tokenizer_sha256=manifest.tokenizer_sha256,
    )
    if env.is_main:
        for note in notes:
            print(f"note: {note}", flush=True)
        print(f"resumed from {path} at step {state['step']}", flush=True)
    return state


def _seed_rank_stream(
    cfg: TrainConfig, env: DistEnv, device: torch.device, state: dict[str, Any] | None
) -> None:
    """Each rank's random stream (dropout): fresh, or the saved one when resuming at the same world
    size, which continues every rank's stream exactly; at another world size, re-seeded by step."""
    if state is None:
        torch.manual_seed(cfg.seed + 1 + env.rank)
        return
    rng = state["rng"]
    if len(rng) != env.world_size:
        torch.manual_seed(cfg.seed + 1 + env.rank + int(state["step"]))
        return
    torch.set_rng_state(rng[env.rank])
    if device.type == "cuda" and state.get("cuda_rng"):
        torch.cuda.set_rng_state(state["cuda_rng"][env.rank], device)


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
    return gather(torch.get_rng_state()), cuda


def save_checkpoint(run: Run, next_step: int, stopping: bool = False, signal: str | None = None) -> None:
    """Collective: every rank contributes its RNG state; global rank 0 writes. ``stopping``: also
    record the stop marker (with ``signal``, the stop signal's name as rank 0 got it), before the
    barrier, so it exists once any rank has exited 75."""
    rng, cuda_rng = _gather_rng(run)
    if run.env.is_main:
        state = {
            "format": checkpoint.FORMAT_VERSION,
            "step": next_step,
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scaler": run.scaler.state_dict() if run.scaler is not None else {},
            "schedule": checkpoint.schedule_of(run.cfg),
            "data": checkpoint.data_position(next_step, run.batches.steps_per_epoch),
            "rng": rng,
            "cuda_rng": cuda_rng,
            "world_size": run.env.world_size,
            "model_shape": asdict(run.model.cfg),
            "config": run.cfg.model_dump(mode="json"),
            "tokenizer_sha256": run.manifest.tokenizer_sha256,
        }
        path = checkpoint.save(state, run.cfg.run_dir, next_step, run.cfg.keep_checkpoints)
        if stopping:
            write_stop_marker(run.cfg.run_dir, next_step, path, signal)
    distributed.barrier()  # nobody exits or moves on before the files are in place


def _compute(run: Run) -> contextlib.ExitStack:
    """Autocast to the run's precision and, for compiled CPU runs, attention through the math SDPA
    backend: inductor fuses its matmuls and softmax into kernels that beat the CPU flash-attention
    kernel at these context lengths (its bf16 backward is ~3x slower than fp32; see benchmarks/)."""
    stack = contextlib.ExitStack()
    if run.autocast_dtype is not None:
        stack.enter_context(torch.autocast(device_type=run.device.type, dtype=run.autocast_dtype))
    if run.cfg.compile and run.device.type == "cpu":
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    return stack


def train_step(run: Run, step: int) -> torch.Tensor:
    """One optimizer step; returns this rank's mean micro-batch loss (a 0-d tensor, not synced)."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, run.cfg)
    accum = run.batches.plan.grad_accum_steps
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(accum):
        x, y = (t.to(run.device, non_blocking=True) for t in run.batches.get(step, micro, run.env.rank))
        # Only the last micro-step all-reduces gradients; the others accumulate locally.
        last = micro == accum - 1
        sync = contextlib.nullcontext() if run.ddp is None or last else run.ddp.no_sync()
        with sync:
            with _compute(run):
                _, loss = run.step_model(x, y)
            loss_sum += loss.detach()
            scaled = loss / accum
            (run.scaler.scale(scaled) if run.scaler is not None else scaled).backward()
    if run.scaler is not None:
        run.scaler.unscale_(run.optimizer)
    if run.cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.grad_clip)
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss_sum / accum


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean validation loss in nats over all ranks' shards (each rank evaluates its own blocks)."""
    run.model.eval()
    totals = torch.zeros(2, device=run.device)
    env, cfg = run.env, run.cfg
    for ids in eval_block_ids(
        len(run.val_tokens), cfg.block_size, cfg.eval_iters, cfg.micro_batch_size, env.world_size, env.rank
    ):
        x, y = (t.to(run.device) for t in blocks_to_batch(run.val_tokens, ids, cfg.block_size))
        with _compute(run):
            _, loss = run.model(x, y)
        assert loss is not None
        totals += torch.stack([loss.float() * len(ids), torch.tensor(float(len(ids)), device=run.device)])
    distributed.all_reduce_sum(totals)
    run.model.train()
    return (totals[0] / totals[1]).item()


def _fault_injection(env: DistEnv) -> int | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    try:
        rank, step = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ConfigError(f"{FAULT_ENV}={spec!r}: use RANK:STEP, e.g. 1:3") from None
    return step if rank == env.rank else None


def loop(run: Run, stop: StopRequest) -> int:
    cfg, env = run.cfg, run.env
    tokens_per_step = run.batches.plan.global_blocks * cfg.block_size
    flops_per_token = run.model.flops_per_token()
    peak = peak_flops(cfg.peak_flops, run.device, run.autocast_dtype or torch.float32) if env.is_main else 1.0
    writer = MetricsWriter(cfg.run_dir, run.start_step) if env.is_main else None
    progress = Progress(cfg.max_steps, run.start_step, enabled=env.is_main)
    fail_at = _fault_injection(env)
    progress.log(
        f"training: world_size={env.world_size} device={run.device} precision={cfg.precision} "
        f"params={run.model.num_params() / 1e6:.2f}M tokens/step={tokens_per_step} "
        f"grad_accum={run.batches.plan.grad_accum_steps} steps {run.start_step}->{cfg.max_steps} "
        f"data={run.manifest.source}"
    )
    train_seconds, steps_since = 0.0, 0  # step time only: evaluation and checkpoints are excluded
    try:
        for step in range(run.start_step, cfg.max_steps):
            if step == fail_at:
                raise RuntimeError(f"injected fault on rank {env.rank} at step {step} ({FAULT_ENV})")
            t0 = time.perf_counter()
            local_loss = train_step(run, step)
            # One all-reduce per step: the loss summed over ranks, and how many ranks got a stop signal.
            stats = distributed.all_reduce_sum(
                torch.stack([local_loss.float(), torch.tensor(float(stop.requested), device=run.device)])
            )
            loss, stopping = stats[0].item() / env.world_size, stats[1].item() > 0
            if not math.isfinite(loss):
                raise TrainingError(
                    f"loss is {loss} at step {step}: lower --lr, raise --warmup-steps or use --precision fp32"
                )
            train_seconds += time.perf_counter() - t0
            steps_since += 1
            done = step + 1
            record: dict[str, Any] = {}
            if done % cfg.log_interval == 0 or done == cfg.max_steps or done == run.start_step + 1:
                tps = tokens_per_step * steps_since / train_seconds
                train_seconds, steps_since = 0.0, 0
                record = {
                    "step": done,
                    "loss": loss,
                    "lr": lr_at(step, cfg),
                    "tokens_per_s": tps,
                    "mfu": flops_per_token * tps / (peak * env.world_size),
                    "world_size": env.world_size,
                }
            if done % cfg.eval_interval == 0 or done == cfg.max_steps:
                val = evaluate(run)
                record |= {"step": done, "loss": loss, "val_loss": val, "val_ppl": math.exp(min(val, 50.0))}
            if record and writer is not None:
                writer.write(record)
                progress.log(_format(record, cfg.max_steps))
            progress.update(done, f"loss {loss:.3f}")
            if stopping or done % cfg.checkpoint_interval == 0 or done == cfg.max_steps:
                save_checkpoint(run, done, stopping, stop.received.name if stop.received else None)
            if stopping:
                progress.log(f"stop signal: checkpoint saved at step {done}; exiting {EXIT_CHECKPOINTED}")
                return EXIT_CHECKPOINTED
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    return EXIT_OK


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
