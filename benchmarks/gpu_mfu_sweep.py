"""The ``all`` mode of ``bench_gpu_mfu.py``: the variants one by one within a time budget, each in a
child process of its own (``bench_gpu_mfu.py one``, ``micro``), ``best`` micro-batch and attention
resolved from the results so far, and ``results.json``, ``summary.md`` and the kept traces rewritten
after every variant."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpu_mfu_report import render
from gpu_mfu_run import REPO_ROOT, WORK, Variant, variant_spec

SCRIPT = Path(__file__).resolve().with_name("bench_gpu_mfu.py")  # what the children run


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
        str(SCRIPT),
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
