"""``launcher report SWEEP`` on a real sweep, in a real browser: two runs of the built-in trainer on
the local scheduler; the page, opened by headless Chromium with no network, draws each run's training
and validation loss, and ranks the runs by their best val_loss, as their own metrics.jsonl says.
The screenshot is kept in ``artifacts/``."""

from __future__ import annotations

import re
from pathlib import Path

from launcher.job.record import JobRecord
from launcher.sweep.record import SweepRecord
from tests.integration.browser import chart, dump_dom, screenshot, traces
from tests.integration.conftest import FAST, launcher, metrics, only_job_id


def test_the_report_of_a_sweep_draws_every_runs_loss_and_ranks_them_by_best_val_loss(
    prepared_data: list[str], tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs"
    done = launcher(
        jobs, "submit", "--nodes", "1", "--sweep", "lr=3e-4,3e-3", "--",
        *prepared_data, *FAST, "--max-steps", "10", "--eval-interval", "5",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    sweep_dir = jobs / only_job_id(jobs)

    made = launcher(jobs, "report", sweep_dir.name, check=True).stdout.strip()
    page = sweep_dir / "report.html"
    assert Path(made) == page and page.is_file()

    # What the page should say, from each run's own metrics: its lowest val_loss, lowest first.
    best = {}
    for run in SweepRecord(sweep_dir).load().runs:
        logged = metrics(Path(JobRecord(sweep_dir / run.job_id).plan().run_dir))
        best[run.job_id] = min(m["val_loss"] for m in logged if "val_loss" in m)
    expected = sorted(best, key=lambda job_id: best[job_id])

    dom = dump_dom(page, tmp_path)
    drawn = {name: traces(dom, name) for name in ("training-loss", "validation-loss")}
    assert drawn == {"training-loss": 2, "validation-loss": 2}, (drawn, dom[-3000:])
    for values in ("lr=3e-4", "lr=3e-3"):  # each line named by its run's values
        assert values in chart(dom, "training-loss"), chart(dom, "training-loss")[-3000:]
    table = dom[dom.index('<table id="ranking">') :]
    table = table[: table.index("</table>")]
    assert _column(table, "job") == expected, table
    assert _column(table, "rank") == ["1", "2"]
    assert _column(table, "best") == [f"{best[job_id]:.4f}" for job_id in expected]
    assert _column(table, "state") == ["succeeded", "succeeded"]
    print(f"\nscreenshot: {screenshot(page, 'report-sweep.png', tmp_path)}")


def _column(table: str, kind: str) -> list[str]:
    """The cells of one column of the ranking table, from the top."""
    return re.findall(rf'<td class="{kind}"[^>]*>([^<]*)</td>', table)
