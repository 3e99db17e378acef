"""One variant of ``bench_gpu_mfu.py`` (its ``one`` mode): the ``Variant`` spec, the ``trainer train``
command line it makes, the switches it applies to the trainer's modules with the profiler around its
steps, and the run itself, whose tokens/s and MFU come from the trainer's ``metrics.jsonl``."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpu_mfu_trace import analyze_trace

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("BENCH_GPU_WORK", "/tmp/bench_gpu_mfu"))
STEPS, LOG_INTERVAL, PROFILE_AT, PROFILE_STEPS = 50, 10, 40, 3
DRY_STEPS, DRY_LOG, DRY_PROFILE_AT = 12, 2, 8


@dataclass(frozen=True)
class Variant:
    name: str
    mb: str = "16"
    accum: int = 1
    attn: str = "torch"
    sync: str = "step"
    mode: str = "default"
    need: float = 0.0  # seconds of budget this variant needs to start (0: --min-run-s)

    @classmethod
    def parse(cls, spec: str) -> Variant:
        name, _, rest = spec.partition(":")
        fields: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            fields[key] = int(value) if key == "accum" else float(value) if key == "need" else value
        return cls(name=name, **fields)

    @property
    def plain(self) -> bool:
        return self.accum == 1 and self.attn == "torch" and self.sync == "step" and self.mode == "default"


def variant_spec(v: Variant) -> str:
    return f"{v.name}:mb={v.mb},accum={v.accum},attn={v.attn},sync={v.sync},mode={v.mode}"


def trainer_argv(v: Variant, mb: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    steps, log = (DRY_STEPS, DRY_LOG) if args.dry else (STEPS, LOG_INTERVAL)
    argv = [
        "train",
        "--preset",
        "tiny" if args.dry else "gpt2",
        "--text-files",
        *args.text_files,
        "--data-dir",
        str(args.data_dir),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(steps),
        "--log-interval",
        str(log),
        "--eval-interval",
        "100000",
        "--eval-iters",
        "1",
        "--checkpoint-interval",
        "100000",
        "--snapshot-interval",
        "0",
        "--micro-batch-size",
        str(mb),
        "--compile-mode",
        v.mode,
    ]
    if v.accum > 1:
        block = 128 if args.dry else 1024
        argv += ["--global-batch-tokens", str(mb * block * v.accum)]
    if args.dry:
        argv += ["--device", "cpu", "--no-compile"]
    return argv


def patch_trainer(v: Variant, args: argparse.Namespace, trace_path: Path, out: dict[str, Any]) -> None:
    """Apply the variant's switches to the trainer's modules, and wrap its step in the profiler."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import trainer.step
    import trainer.train

    if v.attn == "cudnn":  # cuDNN's fused attention first, then torch's own order
        real_compute = trainer.step._compute
        order = [
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ]

        def compute(run):  # type: ignore[no-untyped-def]
            stack = real_compute(run)
            if run.device.type == "cuda":
                stack.enter_context(sdpa_kernel(order, set_priority=True))
            return stack

        trainer.step._compute = compute
    elif v.attn != "torch":
        raise SystemExit(f"attn={v.attn}: use torch or cudnn")

    if v.sync == "log":  # the loss crosses to the host at log steps only (a measurement)
        real_agree = trainer.train.agree

        def agree(run, step, local_loss, stop_requested, compute_s=None):  # type: ignore[no-untyped-def]
            done = step + 1
            c = run.cfg
            if (
                stop_requested
                or done % c.log_interval == 0
                or done == c.max_steps
                or done == run.start_step + 1
            ):
                return real_agree(run, step, local_loss, stop_requested, compute_s)
            return float("nan"), False, None

        trainer.train.agree = agree
    elif v.sync != "step":
        raise SystemExit(f"sync={v.sync}: use step or log")

    real_step = trainer.train.backward  # each step's first call: where the profile starts and ends
    start = DRY_PROFILE_AT if args.dry else PROFILE_AT
    held: dict[str, Any] = {}
    cuda = torch.cuda.is_available() and not args.dry

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def backward(run, step, clock=None):  # type: ignore[no-untyped-def]
        if step == start and os.environ.get("BENCH_PROFILE", "1") != "0":
            sync()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            held["prof"] = torch.profiler.profile(activities=activities)
            held["prof"].__enter__()
            held["t0"] = time.perf_counter()
        elif step == start + PROFILE_STEPS and "prof" in held:
            sync()
            out["profiled_step_wall_ms"] = (time.perf_counter() - held["t0"]) * 1e3 / PROFILE_STEPS
            prof = held.pop("prof")
            prof.__exit__(None, None, None)
            raw = trace_path.with_suffix("")  # .json
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(trace_path, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            out["profile"] = analyze_trace(json.loads(raw.read_text()), PROFILE_STEPS)
            raw.unlink()
        return real_step(run, step, clock)

    trainer.train.backward = backward


def run_one(args: argparse.Namespace) -> int:
    v = Variant.parse(args.variant)
    mb = int(v.mb)
    run_dir = WORK / "runs" / v.name
    shutil.rmtree(run_dir, ignore_errors=True)
    trace = WORK / "traces" / f"trace_{v.name}.json.gz"
    trace.parent.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"variant": asdict(v), "micro_batch": mb, "trace": str(trace)}
    patch_trainer(v, args, trace, out)
    from trainer import cli

    argv = trainer_argv(v, mb, args, run_dir)
    out["argv"] = ["trainer", *argv]
    t0 = time.perf_counter()
    code = cli.main(argv)
    out["wall_s"] = time.perf_counter() - t0
    out["exit"] = code
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    timed = [r for r in records if "tokens_per_s" in r]
    log = DRY_LOG if args.dry else LOG_INTERVAL
    start = DRY_PROFILE_AT if args.dry else PROFILE_AT
    kept = [r for r in timed if log < r["step"] <= start]
    out["records"] = [{k: r[k] for k in ("step", "tokens_per_s", "mfu", "loss")} for r in timed]
    if kept:
        out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in kept)
        out["mfu"] = statistics.median(r["mfu"] for r in kept)
        out["tokens_per_step"] = mb * (128 if args.dry else 1024) * v.accum
        out["step_ms"] = out["tokens_per_step"] / out["tokens_per_s"] * 1e3
    try:
        import torch

        if torch.cuda.is_available() and not args.dry:
            out["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception:
        pass
    shutil.rmtree(run_dir, ignore_errors=True)  # a 1.1 GB checkpoint per variant
    Path(args.result).write_text(json.dumps(out, indent=1))
    return 0 if code == 0 else 1
