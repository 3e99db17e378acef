"""The Markdown summary of ``bench_gpu_mfu.py`` (``summary.md``, and what ``all`` prints at the end):
the variants' table, each profile, and the kernels alone."""

from __future__ import annotations

from typing import Any


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
