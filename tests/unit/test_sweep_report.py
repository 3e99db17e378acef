"""A sweep's report (``launcher.sweep.table``, ``launcher.report.page.render_sweep``): the runs
ranked by the best (lowest) value of a metric, a run with none last; every run's loss on one chart;
``--metric`` only for a sweep. The page in a real browser, of a real sweep:
``tests/integration/test_sweeps.py``."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from launcher.cli.main import main
from launcher.report.page import render_sweep
from launcher.sweep.record import NOT_STARTED, Sweep, SweepRecord, SweepRun
from launcher.sweep.table import Best, RunFacts, SweepFacts, best, ranking


def _run(index: int, metrics: list[dict[str, Any]] | None, lr: str = "1e-3") -> RunFacts:
    return RunFacts(index, {"lr": lr, "seed": str(index)}, "succeeded", 20, 0.9, f"sw-{index}", None, metrics,
                    "" if metrics is not None else "no metrics.jsonl here")  # fmt: skip


def _evals(*val_losses: float) -> list[dict[str, Any]]:
    """A run's records: a log record then an evaluation every 10 steps."""
    records: list[dict[str, Any]] = []
    for k, val in enumerate(val_losses, start=1):
        records.append({"step": 10 * k, "loss": val + 0.1, "tokens_per_s": 1000.0})
        records.append({"step": 10 * k, "loss": val + 0.1, "val_loss": val})
    return records


def test_a_runs_best_is_its_lowest_finite_value_at_its_first_step() -> None:
    assert best(_evals(6.0, 5.5, 5.5, 5.8), "val_loss") == Best(5.5, 20)
    assert best(_evals(6.0, 5.5), "loss") == Best(5.6, 20)
    diverged = [{"step": 1, "val_loss": float("nan")}, {"step": 2, "val_loss": float("inf")}]
    assert best([*diverged, {"step": 3, "val_loss": 7.0}], "val_loss") == Best(7.0, 3)
    assert best(diverged, "val_loss") is None
    assert best([{"step": 1, "val_loss": True}], "val_loss") is None  # a flag, not a number
    assert best(_evals(6.0), "no_such_metric") is None


def test_runs_rank_lower_first_a_run_without_a_value_last_and_unranked() -> None:
    runs = [
        _run(0, _evals(6.0, 5.9)),
        _run(1, None),  # never started, or its run dir is not readable here
        _run(2, _evals(6.0, 5.2, 5.4)),  # its best is not its last
        _run(3, [{"step": 5, "loss": 7.0, "tokens_per_s": 1.0}]),  # no evaluation yet
        _run(4, _evals(5.9)),  # the same best as run 0: the sweep's order
    ]
    ranked = ranking(runs, "val_loss")
    assert [(r.rank, r.run.index, r.best) for r in ranked] == [
        (1, 2, Best(5.2, 20)),
        (2, 0, Best(5.9, 20)),
        (3, 4, Best(5.9, 10)),
        (None, 1, None),
        (None, 3, None),
    ]
    assert [r.run.index for r in ranking(runs, "loss")] == [2, 0, 4, 3, 1]  # any metric, lower first


def _facts(runs: list[RunFacts]) -> SweepFacts:
    return SweepFacts("sw", "local", "2 succeeded", runs, 1_800_000_000.0)


def _column(page: str, kind: str) -> list[str]:
    table = page[page.index("<table id='ranking'>") :]
    return re.findall(rf"<td class='{kind}'[^>]*>([^<]*)</td>", table[: table.index("</table>")])


def test_the_page_overlays_every_runs_loss_and_ranks_the_runs() -> None:
    runs = [_run(0, _evals(6.0, 5.9), lr="3e-4"), _run(1, _evals(6.1, 5.3), lr="3e-3"), _run(2, None)]
    page = render_sweep(_facts(runs), "val_loss")
    assert re.findall(r'<div id="chart-([a-z-]+)"', page) == ["training-loss", "validation-loss"]
    # One trace per run with a loss, named by its values; the run without metrics draws none.
    names = re.findall(r'"name":"([^"]+)"', page)
    assert names.count("lr=3e-4 seed=0") == 2 and names.count("lr=3e-3 seed=1") == 2
    assert "lr=1e-3 seed=2" not in names
    assert _column(page, "job") == ["sw-1", "sw-0", "sw-2"]
    assert _column(page, "rank") == ["1", "2", "-"] and _column(page, "best") == ["5.3000", "5.9000", "-"]
    assert "<th>best val_loss</th>" in page and "<th>goodput</th>" in page
    assert "run 1 (lr=3e-3 seed=1): val_loss 5.3000" in page  # the summary's best run


def test_a_sweep_without_metrics_says_why_instead_of_drawing() -> None:
    page = render_sweep(_facts([_run(0, None), _run(1, [])]), "val_loss")
    assert 'id="chart-' not in page
    assert "no run has logged a training loss yet (run 0: no metrics.jsonl here; run 1: the run is" in page
    assert "no run has logged val_loss yet" in page


def test_report_ranks_a_sweeps_runs_and_refuses_metric_for_a_job(tmp_path: Path, capsys) -> None:
    jobs = tmp_path / "jobs"
    runs = [SweepRun(index=k, values={"lr": lr}, job_id=f"sw-{k}", argv=[]) for k, lr in enumerate("12")]
    SweepRecord.create(jobs / "sw", Sweep(sweep_id="sw", created_at=time.time(), scheduler="local",
                                          max_parallel=1, runs=runs))  # fmt: skip
    assert main(["--jobs-root", str(jobs), "report", "sw", "--metric", "loss"]) == 0
    page = jobs / "sw" / "report.html"
    assert capsys.readouterr().out.strip() == str(page)
    text = page.read_text()
    assert "<th>best loss</th>" in text and _column(text, "state") == [NOT_STARTED, NOT_STARTED]
    assert main(["--jobs-root", str(jobs), "report", "gpt-1", "--metric", "loss"]) == 2
    assert "--metric ranks a sweep's runs: gpt-1 is not a sweep" in capsys.readouterr().err
