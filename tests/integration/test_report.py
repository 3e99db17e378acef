"""``launcher report`` on a real job, in a real browser: a local 2-node job whose rank 1 is SIGKILLed
and retried; its page, opened by headless Chromium with no network, draws every chart from the job's
numbers and shows both attempts with the failure's cause. The screenshot is kept in ``artifacts/``.
TensorBoard's own event reader finds the job's scalars beside the trainer's."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from launcher.job.logs import wait_terminal
from launcher.job.record import JobRecord
from launcher.schedulers.local.scheduler import LocalScheduler
from tests.integration.browser import chart, dump_dom, screenshot, traces
from tests.integration.conftest import FAST, launcher, metrics, only_job_id, wait_for_steps

CHARTS = ("loss", "each-ranks-throughput", "attempts", "where-the-wall-time-went")


def test_the_report_of_a_retried_job_shows_its_charts_offline_and_both_attempts(
    prepared_data, tmp_path: Path
) -> None:
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    submit = launcher(
        jobs, "submit", "--detach", "--nodes", "2", "--retries", "1", "--", *prepared_data, *FAST,
        "--max-steps", "40", "--eval-interval", "10", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_dir = jobs / only_job_id(jobs)
    beats = wait_for_steps([job_dir / "heartbeat" / f"node-{k}" for k in (0, 1)], step=12)
    os.kill(next(b.pid for b in beats if b.rank == 1), signal.SIGKILL)
    final = wait_terminal(LocalScheduler().state, JobRecord(job_dir), 300, poll_s=0.2)
    assert final is not None and final.state == "succeeded", final

    made = launcher(jobs, "report", job_dir.name, check=True).stdout.strip()
    page = job_dir / "report.html"
    assert Path(made) == page and page.is_file()
    said = launcher(jobs, "status", job_dir.name, check=True).stdout
    assert f"report {page}" in said
    logdirs = f"job:{job_dir}/tensorboard/job,trainer:{run_dir}/tensorboard"
    assert f"TensorBoard: tensorboard --logdir_spec {logdirs}" in said

    dom = dump_dom(page, tmp_path)
    # Drawn, with the job's data: plotly put an SVG with one trace per series into each chart's div.
    drawn = {chart: traces(dom, chart) for chart in CHARTS}
    assert drawn == {
        "loss": 2,  # training and validation
        "each-ranks-throughput": 2,  # rank 0 and rank 1
        "attempts": 3,  # attempt 1 (failed), attempt 2, and the checkpoints' marks
        "where-the-wall-time-went": 6,  # goodput's parts
    }, (drawn, dom[-3000:])
    text = _unescaped(dom)
    cause = final.attempts[0].cause
    assert "attempt 1: failed at step " in text and "<li>attempt 2: succeeded; first step " in text
    # Each attempt's start-up, part by part, as its rank 0 named them (``runtime.starting``).
    parts = ["launch", "data", "rendezvous", "setup", "first step"]
    said = r"first step \d+\.\d s after the start: " + ", ".join(rf"{p} \d+\.\d s" for p in parts) + "</li>"
    assert len(re.findall(said, text)) == 2, text[-3000:]
    assert cause and cause in text, (cause, text[-3000:])
    # The figures hold the job's numbers: the last logged loss and rank 1's last throughput.
    last = [m for m in metrics(run_dir) if "tokens_per_s" in m][-1]
    assert json.dumps(last["loss"]) in chart(dom, "loss")
    assert json.dumps(last["rank_tokens_per_s"][1]) in chart(dom, "each-ranks-throughput")
    assert "checkpoint of step 40: " in chart(dom, "attempts")  # the final save, a mark on attempt 2
    print(f"\nscreenshot: {screenshot(page, 'report-retried-job.png', tmp_path)}")
    _assert_tensorboard_shows_the_job(jobs, job_dir, run_dir, cause)


def _assert_tensorboard_shows_the_job(jobs: Path, job_dir: Path, run_dir: Path, cause: str) -> None:
    """TensorBoard's own reader finds the job's numbers (``tensorboard/job`` in the record) and the
    trainer's per-rank ones (the run dir's)."""
    job = _events(job_dir / "tensorboard" / "job")
    attempts = [e.value for e in job.Scalars("job/attempt")]  # at each start, and with each goodput point
    assert attempts[0] == 1.0 and attempts[-1] == 2.0 and attempts == sorted(attempts), attempts
    lines = [e.tensor_proto.string_val[0].decode() for e in job.Tensors("job/attempts")]
    assert lines == ["attempt 1 of 2 started", f"attempt 2 of 2 started after: {cause}"], lines
    # The last point is the ended job's goodput: what `launcher status` says of it.
    status = json.loads(launcher(jobs, "status", job_dir.name, "--json", check=True).stdout)
    last = job.Scalars("goodput/ratio")[-1].value
    assert last == pytest.approx(status["goodput"]["ratio"], rel=1e-6)  # float32 in the event file
    assert job.Scalars("goodput/lost_s")[-1].value == pytest.approx(status["goodput"]["lost_s"], rel=1e-6)
    assert status["report"] == str(job_dir / "report.html")
    # The launcher's per-rank points, from the ranks' beats: each rank's compute time, and no straggler.
    compute = [job.Scalars(f"ranks/compute_s/rank_{rank}")[-1].value for rank in (0, 1)]
    assert all(seconds > 0 for seconds in compute), compute
    assert job.Scalars("ranks/compute_spread")[-1].value == pytest.approx(
        max(compute) / min(compute), rel=1e-5
    )
    ranks = _events(run_dir / "tensorboard").Tags()["scalars"]
    assert {"rank_tokens_per_s/rank_0", "rank_tokens_per_s/rank_1", "rank_tokens_per_s_spread"} <= set(ranks)


def _events(directory: Path) -> EventAccumulator:
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _unescaped(dom: str) -> str:
    return dom.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&#x27;", "'")
