"""The results of a CPU throughput benchmark (``bench_trainer.py``, ``bench_watchdog.py``) as a Markdown
table with its context lines, or as one JSON object."""

from __future__ import annotations

import json
from typing import Any

from throughput import Series


def fmt_ratio(value: float, percent: bool) -> str:
    return f"{value:.1%}" if percent else f"{value:.2f}×"


def ratio_cell(key: str, comparisons: list[dict[str, Any]]) -> str:
    """The ratio column of one configuration's row: each comparison it is the numerator of, else
    "baseline" where it is a denominator."""
    cells = []
    for vals in comparisons:
        if key == vals["numerator"]:
            f = vals["percent"]
            cells.append(
                f"{vals['name']} = **{fmt_ratio(vals['value'], f)}** (rounds {fmt_ratio(vals['min'], f)}–"
                f"{fmt_ratio(vals['max'], f)}; target ≥ {fmt_ratio(vals['target'], f)}: "
                f"{'met' if vals['met'] else 'NOT met'})"
            )
    if cells:
        return "; ".join(cells)
    return "baseline" if any(key == vals["denominator"] for vals in comparisons) else ""


def markdown(series: dict[str, Series], comparisons: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The result table and its context lines, as Markdown."""
    lines = [
        "| configuration | world_size | threads/rank | tokens/s | MFU | ratio |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for key, s in series.items():
        c = s.config
        lines.append(
            f"| {c.label} | {c.world_size} | {c.threads_per_rank} | {s.tokens_per_s:,.0f} | {s.mfu:.1%} | "
            f"{ratio_cell(key, comparisons)} |"
        )
    lines += [
        "",
        f"Medians over {meta['repeats']} interleaved rounds of {meta['steps']} measured steps each "
        f"(after {meta['warmup_steps']} warm-up steps; per run, the median of its "
        f"{meta['log_interval']}-step metrics records); tokens/s is global (all ranks) step throughput. "
        f"Other processes used {meta['other_load_mean']:.0%} of the CPUs on average during the runs "
        f"(worst run {meta['other_load_max']:.0%}). "
        "MFU is the trainer's: model FLOP/s ÷ (matmul peak measured by rank 0 in the run's compute "
        "dtype × world_size), so fp32 and bf16 rows use different peaks.",
        "",
        f"{meta['date']} · torch {meta['torch']} · {meta['cpu']} ({meta['cores']} cores) · "
        f"total {meta['wall_time_s']:.0f} s · `{meta['command']}`",
    ]
    return "\n".join(lines)


def as_json(series: dict[str, Series], comparisons: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The same results as one JSON object."""
    configs = [
        {
            "key": key,
            "label": s.config.label,
            "world_size": s.config.world_size,
            "threads_per_rank": s.config.threads_per_rank,
            "flags": list(s.config.flags),
            "torchrun": s.config.torchrun,
            "tokens_per_s": s.tokens_per_s,
            "mfu": s.mfu,
            "rounds": [vars(r) for r in s.runs],
        }
        for key, s in series.items()
    ]
    return json.dumps({**meta, "configurations": configs, "comparisons": comparisons}, indent=2)
