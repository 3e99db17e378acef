"""Sweeps with real jobs: a grid of the built-in trainer's flags run at most K at a time on the local
scheduler, each run a whole job with its own run dir and a run id for trackers, and its report page in
a real browser; a user's script that gets each value through its placeholders, detached, where a
failed run does not stop the others; a cancelled sweep, whose queued runs never start; and a sweep on
SSH hosts, checked once."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from launcher.job.record import JobRecord, JobState
from launcher.sweep.record import SweepRecord
from tests.integration.browser import chart, dump_dom, screenshot, traces
from tests.integration.conftest import FAST, first_hosts, launcher, metrics, only_job_id, wait_for

STEPS = "10"


def _runs(sweep_dir: Path) -> list[JobRecord]:
    return [JobRecord(sweep_dir / run.job_id) for run in SweepRecord(sweep_dir).load().runs]


def test_a_grid_runs_every_combination_at_most_k_at_once_each_with_its_values_and_run_id(
    prepared_data: list[str], tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs"
    sweep = ["--sweep", "lr=3e-4,1e-3", "--sweep", "seed=1,2", "--max-parallel", "2"]
    done = launcher(
        jobs, "submit", "--nodes", "2", "--gpus-per-node", "1", *sweep, "--",
        *prepared_data, *FAST, "--max-steps", STEPS, "--eval-interval", "5",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    sweep_id = only_job_id(jobs)
    runs = _runs(jobs / sweep_id)
    assert len(runs) == 4 and all(r.status().state == JobState.SUCCEEDED for r in runs)
    # At most 2 at once, and 2 at once indeed: each run's [start, end] against the others'.
    spans = [(r.status().started_at or 0.0, r.status().ended_at or 0.0) for r in runs]
    overlaps = [sum(s <= t < e for s, e in spans) for t, _ in spans]
    assert max(overlaps) == 2, spans
    values = [("3e-4", "1"), ("3e-4", "2"), ("1e-3", "1"), ("1e-3", "2")]
    for record, (lr, seed) in zip(runs, values, strict=True):
        plan = record.plan()
        assert plan.job_id == record.dir.name and plan.run_dir == str(record.dir / "run")
        argv = record.spec().trainer_args
        assert argv[-4:] == ["--lr", lr, "--seed", seed], argv
        logged = metrics(Path(plan.run_dir))
        assert logged[-1]["step"] == int(STEPS) and any("val_loss" in m for m in logged)
        env = plan.nodes[0].env
        assert env["GPTLAUNCH_RUN_ID"] == env["WANDB_RUN_ID"] == plan.job_id
        assert env["WANDB_RUN_GROUP"] == env["GPTLAUNCH_SWEEP_ID"] == sweep_id
    status = launcher(jobs, "status", sweep_id, "--json", check=True).stdout
    rows = json.loads(status)
    assert [(r["state"], r["step"]) for r in rows] == [("succeeded", int(STEPS))] * 4
    assert all(isinstance(r["best_val_loss"], float) for r in rows)
    assert f"{sweep_id} " in launcher(jobs, "list", check=True).stdout  # one line for the sweep
    one = launcher(jobs, "status", runs[3].dir.name, check=True).stdout  # a run, by its id
    assert f"job {runs[3].dir.name}: succeeded" in one
    _check_report(jobs, sweep_id, tmp_path)


def _check_report(jobs: Path, sweep_id: str, tmp_path: Path) -> None:
    """``launcher report SWEEP`` in a real browser (headless Chromium, no network): each run's training
    and validation loss drawn, named by its values, and the runs ranked by their best val_loss, as their
    own metrics.jsonl says. The screenshot is kept in ``artifacts/``."""
    sweep_dir = jobs / sweep_id
    made = launcher(jobs, "report", sweep_id, check=True).stdout.strip()
    page = sweep_dir / "report.html"
    assert Path(made) == page and page.is_file()
    best = {}  # what the page should say, from each run's own metrics: its lowest val_loss, lowest first
    for record in _runs(sweep_dir):
        best[record.dir.name] = min(
            m["val_loss"] for m in metrics(Path(record.plan().run_dir)) if "val_loss" in m
        )
    expected = sorted(best, key=lambda job_id: best[job_id])
    dom = dump_dom(page, tmp_path)
    drawn = {name: traces(dom, name) for name in ("training-loss", "validation-loss")}
    assert drawn == {"training-loss": 4, "validation-loss": 4}, (drawn, dom[-3000:])
    assert "lr=1e-3 seed=2" in chart(dom, "training-loss")  # each line named by its run's values
    table = dom[dom.index('<table id="ranking">') :]
    table = table[: table.index("</table>")]
    assert _column(table, "job") == expected, table
    assert _column(table, "rank") == ["1", "2", "3", "4"]
    assert _column(table, "best") == [f"{best[job_id]:.4f}" for job_id in expected]
    print(f"\nscreenshot: {screenshot(page, 'report-sweep.png', tmp_path)}")


def _column(table: str, kind: str) -> list[str]:
    """The cells of one column of the ranking table, from the top."""
    return re.findall(rf'<td class="{kind}"[^>]*>([^<]*)</td>', table)


SCRIPT = """import os, sys, time
from pathlib import Path
lr = sys.argv[sys.argv.index("--lr") + 1]
out = Path(os.environ["GPTLAUNCH_RUN_DIR"])
out.mkdir(parents=True, exist_ok=True)
(out / "lr.txt").write_text(lr)
if lr == "bad":
    sys.exit(1)
while (Path(sys.argv[0]).parent / "hold").exists():  # the cancel test holds its first run here
    time.sleep(0.1)
"""


def test_a_scripts_placeholders_get_each_value_and_a_failed_run_does_not_stop_the_others(
    tmp_path: Path,
) -> None:
    (tmp_path / "sweep_me.py").write_text(SCRIPT)
    jobs = tmp_path / "jobs"
    argv = [
        "submit",
        "--detach",
        "--workdir",
        str(tmp_path),
        "--sweep",
        "lr=0.1,bad,0.3",
        "--max-parallel",
        "1",
    ]
    sweep = launcher(jobs, *argv, "--", "sweep_me.py", "--lr", "{lr}")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    sweep_id = sweep.stdout.split()[0]
    waited = launcher(jobs, "wait", sweep_id)
    assert waited.returncode == 1, waited.stderr  # the worst run's code
    runs = _runs(jobs / sweep_id)
    assert [r.status().state for r in runs] == [JobState.SUCCEEDED, JobState.FAILED, JobState.SUCCEEDED]
    assert [(Path(r.plan().run_dir) / "lr.txt").read_text() for r in runs] == ["0.1", "bad", "0.3"]


def test_a_cancelled_sweep_stops_its_running_run_and_starts_no_other(tmp_path: Path) -> None:
    (tmp_path / "sweep_me.py").write_text(SCRIPT)
    (tmp_path / "hold").touch()
    jobs = tmp_path / "jobs"
    argv = ["submit", "--detach", "--workdir", str(tmp_path), "--sweep", "lr=1,2", "--max-parallel", "1"]
    sweep = launcher(jobs, *argv, "--", "sweep_me.py", "--lr", "{lr}")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    sweep_id = sweep.stdout.split()[0]
    first = jobs / sweep_id / f"{sweep_id}-0" / "run" / "lr.txt"
    wait_for(first.is_file, 120, "the first run to start")
    cancel = launcher(jobs, "cancel", sweep_id)
    assert cancel.returncode == 0, cancel.stderr
    waited = launcher(jobs, "wait", sweep_id)
    assert waited.returncode == 130, waited.stderr
    rows = json.loads(launcher(jobs, "status", sweep_id, "--json", check=True).stdout)
    assert [r["state"] for r in rows] == ["cancelled", "not started"], rows
    assert not (jobs / sweep_id / f"{sweep_id}-1").exists()
    wait_for(lambda: not SweepRecord(jobs / sweep_id).driver_alive(), 30, "the sweep's driver to end")
    os.remove(tmp_path / "hold")


def test_an_ssh_sweep_checks_its_hosts_once_and_each_run_trains_on_them(
    hostfile: Path, tmp_path: Path
) -> None:
    """On SSH hosts, version parity and the health gate run once for the sweep; its runs get the hosts
    in the order the checks left them (spare last) and check them no more."""
    (tmp_path / "sweep_me.py").write_text(SCRIPT)
    hosts, jobs = first_hosts(hostfile, 3, tmp_path), tmp_path / "jobs"
    argv = ["submit", "--scheduler", "ssh", "--hostfile", str(hosts), "--nodes", "2", "--gpus-per-node", "1"]
    argv += ["--health-check", "--workdir", str(tmp_path), "--sweep", "lr=1,2"]
    done = launcher(jobs, *argv, "--", "sweep_me.py", "--lr", "{lr}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("health gate: no host named") == 1, done.stderr
    assert "the sweep's hosts passed parity and the health gate: its runs check them no more" in done.stderr
    sweep_id = only_job_id(jobs)
    names = [line.split()[0] for line in hosts.read_text().splitlines()]
    for k, record in enumerate(_runs(jobs / sweep_id)):
        assert record.status().state == JobState.SUCCEEDED
        options = record.spec().scheduler
        assert (options.hosts, options.skip_parity, options.gate) == (names, True, False)  # type: ignore[union-attr]
        assert "health gate" not in (jobs / sweep_id / f"{record.dir.name}.submit.log").read_text()
        assert (Path(record.plan().run_dir) / "lr.txt").read_text() == str(k + 1)
