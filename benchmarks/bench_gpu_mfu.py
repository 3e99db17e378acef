"""GPT-2-size throughput and MFU of the trainer on one GPU, variant by variant, with a profile of each.

Every variant is one ``trainer train --preset gpt2`` run (1024-token sequences, bf16 autocast,
``torch.compile``) in a process of its own, on data prepared once. Its figures are the trainer's own
``tokens_per_s`` and ``mfu`` from ``metrics.jsonl`` (MFU: 6N + 12·L·d·T FLOPs per token against the
datasheet peak that ``trainer.metrics.KNOWN_PEAK_FLOPS`` gives the GPU, 989 TFLOP/s for an H200):
the median of the log records of steps 11–40, after the first interval (which holds the compile) and
before the profiled steps. Steps 41–43 run under ``torch.profiler``; the trace of each variant is
summarised (GPU busy and idle time per step, kernel time by kind, the top kernels).

A variant is ``NAME:key=value,...`` with keys

- ``mb``: micro-batch (sequences); ``best``: the fastest micro-batch of the plain variants run so far;
- ``accum``: micro-steps per optimizer step (``--global-batch-tokens``), default 1;
- ``attn``: ``torch`` (torch's own SDPA order: the trainer as it is; torch 2.11 picks cuDNN's fused
  attention on an H200 by itself) or ``cudnn`` (``sdpa_kernel`` with cuDNN first, then torch's order,
  around the trainer's compute context); ``best``: the faster of a pair measured at one micro-batch;
- ``sync``: ``step`` (the trainer: the loss is read on the host after every step) or ``log`` (only at
  log steps: what the per-step host sync costs; a measurement, not a trainer mode);
- ``mode``: the ``--compile-mode`` (``default``, ``reduce-overhead``, ``max-autotune-no-cudagraphs``);
- ``need``: seconds of the budget the variant needs to start (max-autotune compiles for minutes).

``BENCH_PROFILE=0`` leaves the profiler out. ``benchmarks/gpu_session.sh`` runs this with the GPU tests
in one call on a machine without network; figures and the commands are in docs/benchmarks.md.

Usage (on the GPU machine; ``--dry``: the tiny preset on the CPU without compile, the same code paths
in seconds):

    python3 benchmarks/bench_gpu_mfu.py all --out DIR --budget-s 240 --micro \\
        --variants b16:mb=16 b32:mb=32 cudnn:mb=best,attn=cudnn
    python3 benchmarks/bench_gpu_mfu.py one ...    # one variant (what ``all`` starts per variant)
    python3 benchmarks/bench_gpu_mfu.py micro ...  # GEMMs and attention of the model alone

``all`` appends to ``DIR/results.json`` and rewrites ``DIR/summary.md`` after every variant, so a run
cut short keeps what it measured; it copies the first variant's trace and the fastest one's there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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


# ----------------------------------------------------------------------------------------- one run


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

        def agree(run, step, local_loss, stop_requested):  # type: ignore[no-untyped-def]
            done = step + 1
            c = run.cfg
            if (
                stop_requested
                or done % c.log_interval == 0
                or done == c.max_steps
                or done == run.start_step + 1
            ):
                return real_agree(run, step, local_loss, stop_requested)
            return float("nan"), False

        trainer.train.agree = agree
    elif v.sync != "step":
        raise SystemExit(f"sync={v.sync}: use step or log")

    real_step = trainer.train.train_step
    start = DRY_PROFILE_AT if args.dry else PROFILE_AT
    held: dict[str, Any] = {}
    cuda = torch.cuda.is_available() and not args.dry

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def train_step(run, step, clock=None):  # type: ignore[no-untyped-def]
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

    trainer.train.train_step = train_step


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


# ------------------------------------------------------------------------------------ the profile

KINDS = (  # first match wins; names as CUDA 12/13 kernels of cuBLAS, cuDNN, flash, Inductor, torch
    ("gemm", ("triton_tem_",)),  # Inductor's matmul templates (max-autotune)
    ("triton (Inductor)", ("triton_",)),  # before attention: its names hold the aten ops they fuse
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn")),  # cuDNN's dO·O and dQ kernels too
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "s16816", "splitk")),
    ("optimizer + clip", ("adam", "lpnorm", "multi_tensor")),
)


def kind_of(name: str, cat: str) -> str:
    if cat in ("gpu_memcpy", "gpu_memset") or name.startswith(("Memcpy", "Memset")):
        return "copy/memset"
    low = name.lower()
    for kind, marks in KINDS:
        if any(m.lower() in low for m in marks):
            return kind
    return "other (eager aten)"


def analyze_trace(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Per step, from a Chrome trace of ``steps`` whole steps: the GPU's busy time (the union of its
    kernels, copies and memsets) and idle time inside the span from its first to its last, kernel
    time by kind, and the top kernels by total time."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    result: dict[str, Any] = {"steps": steps, "gpu_events": len(gpu)}
    if not gpu:
        return result
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu)
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = spans[-1][1] - spans[0][0]
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in gpu:
        dur = float(e.get("dur", 0))
        k = kind_of(e["name"], e["cat"])
        by_kind[k] = by_kind.get(k, 0.0) + dur
        by_name.setdefault(e["name"], []).append(dur)
    total = sum(by_kind.values())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:20]
    result.update(
        {
            "gpu_window_ms_per_step": window / 1e3 / steps,
            "gpu_busy_ms_per_step": busy / 1e3 / steps,
            "gpu_idle_ms_per_step": (window - busy) / 1e3 / steps,
            "kernels_per_step": len(gpu) / steps,
            "kernel_ms_per_step": total / 1e3 / steps,
            "by_kind_ms_per_step": {
                k: v / 1e3 / steps for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
            },
            "top_kernels": [
                {
                    "name": name[:140],
                    "kind": kind_of(name, "kernel"),
                    "ms_per_step": sum(d) / 1e3 / steps,
                    "calls_per_step": len(d) / steps,
                    "share": sum(d) / total if total else 0.0,
                }
                for name, d in top
            ],
        }
    )
    return result


# --------------------------------------------------------------------------- GEMMs and attention alone


def run_micro(args: argparse.Namespace) -> int:
    """The model's matmuls and attention alone, forward + backward, each timed by
    ``triton.testing.do_bench`` (median; L2 flushed between calls), at micro-batches 16 and 32, and the
    matmul and copy ceilings of the card; the sum is the step time if nothing else took any."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = "cpu" if args.dry else "cuda"
    if args.dry:

        def bench(fn) -> float:  # type: ignore[no-untyped-def]
            fn()
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            return (time.perf_counter() - t0) / 3 * 1e3
    else:
        from triton.testing import do_bench

        def bench(fn) -> float:  # type: ignore[no-untyped-def]
            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))

    d, layers, vocab, t_len, heads = (256, 4, 8192, 128, 4) if args.dry else (768, 12, 8192, 1024, 12)
    dt = torch.bfloat16
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt, generator=g).requires_grad_(grad)

    n = 1024 if args.dry else 8192
    a, b = rnd(n, n), rnd(n, n)
    ms = bench(lambda a=a, b=b: a @ b)
    out["matmul_tflops"] = {"shape": f"{n}x{n}x{n}", "ms": ms, "tflops": 2 * n**3 / ms / 1e9}
    del a, b
    x = torch.empty(2**28 if not args.dry else 2**22, device=dev, dtype=torch.uint8)
    ms = bench(lambda x=x: x.clone())
    out["copy_gbs"] = {"bytes": x.numel(), "ms": ms, "gbs": 2 * x.numel() / ms / 1e6}  # read + write
    del x

    rows = []
    for mb in (16, 32):
        m = mb * t_len
        linears = {
            "qkv": (d, 3 * d, True),
            "attn.proj": (d, d, True),
            "mlp.fc": (d, 4 * d, True),
            "mlp.proj": (4 * d, d, True),
            "lm_head": (d, vocab, False),
        }
        per_mb: dict[str, Any] = {"micro_batch": mb, "tokens": m, "ops": {}}
        floor_ms = 0.0
        for name, (k, nout, bias) in linears.items():
            xi, w = rnd(m, k, grad=True), rnd(nout, k, grad=True)
            bb = rnd(nout, grad=True) if bias else None
            gy = rnd(m, nout)
            inputs = (xi, w) if bb is None else (xi, w, bb)

            def fb(xi=xi, w=w, bb=bb, gy=gy, inputs=inputs) -> None:
                torch.autograd.grad(F.linear(xi, w, bb), inputs, gy)

            ms = bench(fb)
            flops = 6 * m * k * nout
            count = 1 if name == "lm_head" else layers
            per_mb["ops"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "times_per_step": count}
            floor_ms += ms * count
            del xi, w, bb, gy, inputs
        q, kk, vv = (rnd(mb, heads, t_len, d // heads, grad=True) for _ in range(3))
        go = rnd(mb, heads, t_len, d // heads)
        # Causal attention as computed (half the scores), and as the MFU formula counts it (all).
        causal_flops = 4 * mb * heads * t_len * t_len * (d // heads) * 0.5 * 3.5
        attn: dict[str, Any] = {}
        for backend in (
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
        ):
            if args.dry and backend != SDPBackend.FLASH_ATTENTION:
                continue

            def fa(backend=backend, q=q, kk=kk, vv=vv, go=go) -> None:
                with sdpa_kernel(backend if not args.dry else SDPBackend.MATH):
                    y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
                torch.autograd.grad(y, (q, kk, vv), go)

            try:
                ms = bench(fa)
                attn[backend.name] = {"ms": ms, "tflops_causal": causal_flops / ms / 1e9}
            except RuntimeError as e:
                attn[backend.name] = {"error": str(e).splitlines()[0][:200]}
        per_mb["attention_fwd_bwd"] = attn
        best_attn = min((v["ms"] for v in attn.values() if "ms" in v), default=0.0)
        per_mb["gemm_floor_ms"] = floor_ms
        per_mb["gemm_attention_floor_ms"] = floor_ms + layers * best_attn
        flops_per_token = 6 * (layers * 12 * d * d + vocab * d) + 12 * layers * d * t_len  # ~ the model's
        per_mb["mfu_if_only_these"] = flops_per_token * m / (per_mb["gemm_attention_floor_ms"] / 1e3) / 989e12
        rows.append(per_mb)
        del q, kk, vv, go
        if dev == "cuda":
            torch.cuda.empty_cache()
    out["shapes"] = rows
    Path(args.result).write_text(json.dumps(out, indent=1))
    return 0


# ----------------------------------------------------------------------------------- all variants


def load(out_dir: Path) -> dict[str, Any]:
    path = out_dir / "results.json"
    if path.is_file():
        return json.loads(path.read_text())
    return {"variants": [], "micro": None}


def best_plain_mb(results: dict[str, Any]) -> int | None:
    plain = [r for r in results["variants"] if r.get("tokens_per_s") and Variant(**r["variant"]).plain]
    return max(plain, key=lambda r: r["tokens_per_s"])["micro_batch"] if plain else None


def best_attn(results: dict[str, Any], mb: int) -> str:
    """The faster attention of a pair measured at one micro-batch (the same one where measured, else
    the largest), all else as the trainer's; cudnn (the trainer's default) when no pair is."""
    pairs: dict[int, dict[str, float]] = {}
    for r in results["variants"]:
        v = Variant(**r["variant"])
        if r.get("tokens_per_s") and v.accum == 1 and v.sync == "step" and v.mode == "default":
            pairs.setdefault(r["micro_batch"], {})[v.attn] = r["tokens_per_s"]
    both = {m: p for m, p in pairs.items() if len(p) == 2}
    if not both:
        return "cudnn"
    pair = both.get(mb) or both[max(both)]
    return max(pair, key=lambda a: pair[a])


def cudnn_failed(results: dict[str, Any]) -> bool:
    return any(r["variant"]["attn"] == "cudnn" and not r.get("tokens_per_s") for r in results["variants"])


def child(mode: str, args: argparse.Namespace, extra: list[str], result: Path, timeout: float, log) -> int:  # type: ignore[no-untyped-def]
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        mode,
        "--result",
        str(result),
        "--data-dir",
        str(args.data_dir),
        "--text-files",
        *args.text_files,
        *extra,
    ]
    if args.dry:
        argv.append("--dry")
    log.write(f"\n===== {' '.join(argv)}\n")
    log.flush()
    try:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        log.write(f"===== timed out after {timeout:.0f} s\n")
        return 124
    return proc.returncode


def run_all(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    results = load(out_dir)
    results.setdefault("env", env_info())
    log = open(out_dir / "children.log", "a")  # noqa: SIM115 - for the whole run
    if not (args.data_dir / "manifest.json").is_file():
        t0 = time.monotonic()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer.cli",
                "prepare",
                "--text-files",
                *args.text_files,
                "--data-dir",
                str(args.data_dir),
            ],
            check=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        print(f"data prepared in {time.monotonic() - t0:.1f} s", flush=True)

    def left() -> float:
        return args.budget_s - (time.monotonic() - t_start)

    queue: list[str] = list(args.variants)
    if args.micro:
        queue.insert(args.micro_after, "@micro")
    for spec in queue:
        need = Variant.parse(spec).need if spec != "@micro" else 0.0
        if left() < max(need, args.min_run_s):
            print(f"skipped {spec}: {left():.0f} s of the budget left", flush=True)
            results.setdefault("skipped", []).append(spec)
            continue
        if spec == "@micro":
            res = WORK / "micro.json"
            res.unlink(missing_ok=True)
            t0 = time.monotonic()
            code = child("micro", args, [], res, min(120.0, left()), log)
            results["micro"] = json.loads(res.read_text()) if res.is_file() else {"exit": code}
            print(f"micro: exit {code} in {time.monotonic() - t0:.0f} s", flush=True)
            save(out_dir, results, args)
            continue
        v = Variant.parse(spec)
        if v.mb == "best":
            best = best_plain_mb(results)
            v = Variant(**{**asdict(v), "mb": str(best or 16)})
        if v.attn == "best":
            v = Variant(**{**asdict(v), "attn": best_attn(results, int(v.mb))})
        if v.attn == "cudnn" and cudnn_failed(results):  # it fails alike every time
            v = Variant(**{**asdict(v), "attn": "torch", "name": v.name + "-torch"})
        res = WORK / f"result_{v.name}.json"
        res.unlink(missing_ok=True)
        t0 = time.monotonic()
        code = child("one", args, ["--variant", variant_spec(v)], res, min(args.run_timeout_s, left()), log)
        wall = time.monotonic() - t0
        r = json.loads(res.read_text()) if res.is_file() else {"variant": asdict(v), "micro_batch": int(v.mb)}
        r.update({"exit": code, "process_wall_s": wall})
        results["variants"] = [x for x in results["variants"] if x["variant"]["name"] != v.name] + [r]
        if r.get("tokens_per_s"):
            print(
                f"{v.name}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%} "
                f"(mb {r['micro_batch']}, step {r['step_ms']:.1f} ms; process {wall:.0f} s)",
                flush=True,
            )
        else:
            print(f"{v.name}: FAILED (exit {code}, {wall:.0f} s): see children.log", flush=True)
        save(out_dir, results, args)
    log.close()
    print(render(results), flush=True)
    return 0


def variant_spec(v: Variant) -> str:
    return f"{v.name}:mb={v.mb},accum={v.accum},attn={v.attn},sync={v.sync},mode={v.mode}"


def save(out_dir: Path, results: dict[str, Any], args: argparse.Namespace) -> None:
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "summary.md").write_text(render(results))
    done = [r for r in results["variants"] if r.get("tokens_per_s") and Path(r.get("trace", "")).is_file()]
    if done:  # the first variant's trace (the baseline) and the fastest one's
        shutil.copy(done[0]["trace"], out_dir / "trace_base.json.gz")
        best = max(done, key=lambda r: r["tokens_per_s"])
        if best is not done[0]:
            shutil.copy(best["trace"], out_dir / "trace_best.json.gz")


def env_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            info["cudnn"] = torch.backends.cudnn.version()
        import triton

        info["triton"] = triton.__version__
    except Exception as e:
        info["error"] = repr(e)
    return info


def render(results: dict[str, Any]) -> str:
    lines = [
        "| variant | micro-batch × accum | attention | host sync | compile mode | tokens/s | MFU | "
        "step, ms | GPU busy / idle per step, ms | peak mem, GiB |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["variants"]:
        v = r["variant"]
        p = r.get("profile") or {}
        busy = (
            f"{p['gpu_busy_ms_per_step']:.1f} / {p['gpu_idle_ms_per_step']:.1f}"
            if "gpu_busy_ms_per_step" in p
            else ""
        )
        if r.get("tokens_per_s"):
            figs = f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['step_ms']:.1f}"
        else:
            figs = f"failed (exit {r.get('exit')}) | | "
        mem = f"{r['max_memory_gib']:.1f}" if "max_memory_gib" in r else ""
        lines.append(
            f"| {v['name']} | {r['micro_batch']} × {v['accum']} | {v['attn']} | {v['sync']} | "
            f"{v['mode']} | {figs} | {busy} | {mem} |"
        )
    for r in results["variants"]:
        p = r.get("profile") or {}
        if "by_kind_ms_per_step" not in p:
            continue
        lines += [
            "",
            f"### profile of {r['variant']['name']} ({p['steps']} steps; per step: GPU window "
            f"{p['gpu_window_ms_per_step']:.2f} ms, busy {p['gpu_busy_ms_per_step']:.2f}, idle "
            f"{p['gpu_idle_ms_per_step']:.2f}, {p['kernels_per_step']:.0f} kernels; host wall "
            f"{r.get('profiled_step_wall_ms', 0):.2f} ms)",
            "",
        ]
        lines += ["| kind | ms/step | share |", "| --- | ---: | ---: |"]
        total = p["kernel_ms_per_step"]
        lines += [f"| {k} | {ms:.2f} | {ms / total:.1%} |" for k, ms in p["by_kind_ms_per_step"].items()]
        lines += [
            "",
            "| top kernels | kind | ms/step | calls/step | share |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        lines += [
            f"| `{k['name'][:90]}` | {k['kind']} | {k['ms_per_step']:.2f} | {k['calls_per_step']:.0f} | "
            f"{k['share']:.1%} |"
            for k in p["top_kernels"][:12]
        ]
    m = results.get("micro")
    if m and "shapes" in m:
        lines += [
            "",
            f"### kernels alone ({m['device']}): matmul {m['matmul_tflops']['shape']} "
            f"{m['matmul_tflops']['tflops']:.0f} TFLOP/s, copy {m['copy_gbs']['gbs']:.0f} GB/s",
            "",
        ]
        for row in m["shapes"]:
            ops = ", ".join(
                f"{k} {o['ms']:.3f} ms ({o['tflops']:.0f} TFLOP/s)" for k, o in row["ops"].items()
            )
            attn = ", ".join(
                f"{k} {a['ms']:.3f} ms ({a['tflops_causal']:.0f} TFLOP/s causal)"
                if "ms" in a
                else f"{k}: {a['error']}"
                for k, a in row["attention_fwd_bwd"].items()
            )
            lines.append(
                f"- micro-batch {row['micro_batch']}, fwd+bwd: {ops}; attention {attn}; "
                f"GEMMs {row['gemm_floor_ms']:.2f} ms + attention = {row['gemm_attention_floor_ms']:.2f} ms "
                f"per step: MFU {row['mfu_if_only_these']:.1%} if nothing else took time"
            )
    if results.get("skipped"):
        lines += ["", f"skipped (budget): {', '.join(results['skipped'])}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("all", "one", "micro"))
    p.add_argument("--out", default="bench_gpu_out")
    p.add_argument("--variants", nargs="*", default=["b16:mb=16", "b32:mb=32"])
    p.add_argument("--variant", help="one: the variant")
    p.add_argument("--result", help="one/micro: where the result JSON goes")
    p.add_argument("--micro", action="store_true", help="all: also time the GEMMs and attention alone")
    p.add_argument("--micro-after", type=int, default=1, help="all: after this many variants")
    p.add_argument("--budget-s", type=float, default=300.0, help="all: no variant starts after this")
    p.add_argument("--min-run-s", type=float, default=40.0, help="all: a variant needs this much budget left")
    p.add_argument("--run-timeout-s", type=float, default=150.0)
    p.add_argument(
        "--text-files", nargs="+", default=[str(REPO_ROOT.parent / "shared/data/wikitext-2/valid.txt")]
    )
    p.add_argument("--data-dir", type=Path, default=WORK / "data")
    p.add_argument(
        "--dry", action="store_true", help="tiny preset on the CPU, no compile: the code paths only"
    )
    args = p.parse_args()
    args.text_files = [str(Path(f).resolve()) for f in args.text_files]
    if args.mode == "one":
        return run_one(args)
    if args.mode == "micro":
        return run_micro(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
