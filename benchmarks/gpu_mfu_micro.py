"""The ``micro`` mode of ``bench_gpu_mfu.py``: the model's GEMMs and attention alone, forward + backward,
and the card's matmul and copy ceilings."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


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
