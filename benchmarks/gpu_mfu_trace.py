"""The profile of a ``bench_gpu_mfu.py`` variant: a ``torch.profiler`` Chrome trace summarised per step
(GPU busy and idle time, kernel time by kind, the top kernels)."""

from __future__ import annotations

from typing import Any

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
