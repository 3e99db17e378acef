"""The report page (``launcher.report``): a chart for each kind of data the job has, and words, never
an empty chart, for what it lacks; plotly's script inline, so the page needs no network. The page in
a real browser is tested on a real job in ``tests/integration/test_report.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path

from launcher.job.goodput import Goodput
from launcher.job.measurements import CollectiveResult, DeviceResult, PairResult
from launcher.job.plan import Plan
from launcher.job.record import Attempt, JobState, JobStatus
from launcher.preflight import recorded
from launcher.preflight.recorded import Checks
from launcher.report.facts import Facts, Mark, checkpoints, files, read_metrics, spans
from launcher.report.page import render
from tests.unit.test_parity import make_probe

T0 = 1_800_000_000.0
GOODPUT = Goodput(wall_s=100, training_s=90, startup_s=3, lost_s=4, checkpoint_s=1, eval_s=1, other_s=1,
                  failures=1, steps_redone=[0])  # fmt: skip
PLAN = Plan(job_id="gpt-1", scheduler="local", nnodes=2, nproc_per_node=1, rdzv_endpoint="127.0.0.1:29500",
            run_dir="/runs/a", nodes=[])  # fmt: skip
METRICS = [
    {"step": 10, "loss": 7.5, "tokens_per_s": 5000.0, "rank_tokens_per_s": [9000.0, 4000.0]},
    {"step": 20, "loss": 6.5, "tokens_per_s": 5100.0, "val_loss": 6.6, "rank_tokens_per_s": [9100.0, 4100.0]},
]


def _status() -> JobStatus:
    failed = Attempt(number=1, started_at=T0, ended_at=T0 + 40, exit_code=1,
                     cause="rank 1 on node 1: SIGKILL", step=16, replaced={"gl-h2": "gl-h3"})  # fmt: skip
    return JobStatus(state=JobState.SUCCEEDED, exit_code=0, created_at=T0, started_at=T0 + 41,
                     ended_at=T0 + 100, attempt=2, attempts=[failed])  # fmt: skip


def _facts(**changes: object) -> Facts:
    status = _status()
    facts = {
        "plan": PLAN, "status": status, "spans": spans(status, T0 + 100), "goodput": GOODPUT,
        "metrics": METRICS, "metrics_note": "", "files": [("attempt 1: node 0 log", "attempts/1/node-0.log")],
        "made_at": T0 + 100, "checks": Checks({}, None, []), "marks": [], "rank_compute": {},
    }  # fmt: skip
    return Facts(**{**facts, **changes})  # type: ignore[arg-type]


def _charts(page: str) -> list[str]:
    return re.findall(r'<div id="chart-([a-z-]+)"', page)


def test_every_chart_is_drawn_from_the_jobs_numbers_with_plotly_inline() -> None:
    page = render(_facts())
    assert _charts(page) == ["loss", "each-ranks-throughput", "attempts", "where-the-wall-time-went"]
    tags = re.findall(r"<script[^>]*>", page)
    assert len(tags) == 5 and not any("src" in tag for tag in tags)  # plotly's, inline; one per chart
    failed = "attempt 1: failed at step 16: rank 1 on node 1: SIGKILL (gl-h2 replaced by gl-h3)"
    assert f"<li>{failed}</li>" in page
    assert "attempt 2: succeeded" in page and "Goodput 90.0%" in page and "training 90.0%" in page
    assert '"name":"rank 1"' in page and "4100.0" in page  # each rank's line, with its numbers
    assert "<a href='attempts/1/node-0.log'>attempt 1: node 0 log</a>" in page


def test_missing_data_is_said_in_words_never_an_empty_chart() -> None:
    page = render(
        _facts(metrics=None, metrics_note="no metrics.jsonl in /runs/a on this machine", goodput=None)
    )
    assert _charts(page) == ["attempts"]
    assert page.count("no metrics.jsonl in /runs/a on this machine") == 2  # loss, throughput
    assert "goodput needs the ranks&#x27; heartbeats" in page
    plain = render(_facts(metrics=[{"step": 5, "loss": 7.0, "tokens_per_s": 1.0}]))
    assert _charts(plain) == ["loss", "attempts", "where-the-wall-time-went"]
    assert "the metrics carry no per-rank times" in plain and "the launcher recorded no rank" in plain
    unstarted = JobStatus(state=JobState.PENDING, created_at=T0)
    page = render(_facts(status=unstarted, spans=spans(unstarted, T0), goodput=None, metrics=None, files=[]))
    assert _charts(page) == [] and "the job has not started yet" in page and "no node log" in page


def test_a_script_that_logs_no_per_rank_times_gets_the_launchers_compute_time_of_each_rank() -> None:
    """No metrics.jsonl (a script of the user's own): each rank's line is the launcher's points, rank
    1's apart from rank 0's."""
    series = {0: [(T0 + 15, 0.1), (T0 + 30, 0.1)], 1: [(T0 + 15, 0.1), (T0 + 30, 0.3)]}
    page = render(_facts(metrics=None, metrics_note="no metrics.jsonl in /runs/a", rank_compute=series))
    assert _charts(page) == ["each-ranks-throughput", "attempts", "where-the-wall-time-went"]
    assert "compute per step" in page and '"name":"rank 1"' in page and "0.3" in page
    trained = render(_facts(rank_compute=series))  # the trainer's own numbers come first
    assert "own throughput" in trained and "compute per step" not in trained


def test_metrics_lines_cut_short_are_skipped_and_a_missing_file_is_explained(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 7.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == ([{"step": 1, "loss": 7.0}], "")
    records, why = read_metrics(tmp_path / "elsewhere")
    assert records is None and "no metrics.jsonl in" in why and "a script of your own" in why


def test_the_files_are_each_attempts_logs_and_hang_stacks_relative_to_the_job(tmp_path: Path) -> None:
    for name in (
        "attempts/1/node-0.log",
        "attempts/1/hang/node1-rank1.txt",
        "attempts/10/node-0.log",
        "node-0.log",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert files(tmp_path) == [
        ("attempt 1: node 0 log", "attempts/1/node-0.log"),
        ("attempt 1: hang stack node1-rank1", "attempts/1/hang/node1-rank1.txt"),
        ("attempt 10: node 0 log", "attempts/10/node-0.log"),
        ("last attempt: node 0 log", "node-0.log"),
    ]


def gate_result(slow_link: str, slow_device: str) -> CollectiveResult:
    """Three hosts' gate: the pairs of ``slow_link``'s host at 0.05 GB/s (the others 1.0), and
    ``slow_device``'s host's CPU at 0.1 TFLOP/s (the others 1.0)."""
    hosts = ["h1", "h2", "h3"]
    pairs = [
        PairResult(round=r, nodes=(a, b), bytes=2**24, time_us=900.0,
                   busbw_gbs=0.05 if slow_link in (hosts[a], hosts[b]) else 1.0)
        for r, (a, b) in enumerate([(0, 1), (1, 2), (2, 0)])
    ]  # fmt: skip
    compute = [
        DeviceResult(rank=k, node=k, local_rank=0, device="cpu", kind="cpu", dtype="float32", size=256,
                     tflops=0.1 if host == slow_device else 1.0)
        for k, host in enumerate(hosts)
    ]  # fmt: skip
    return CollectiveResult(
        backend="gloo", world_size=3, hosts=hosts, ifname={}, master="h1:29500", torch="2.13.0", iters=5,
        warmup=2, init_s=0.1, results=[], pairs=pairs, compute=compute,
    )  # fmt: skip


def test_the_checks_before_training_are_recorded_and_shown_with_the_named_hosts(tmp_path: Path) -> None:
    probes = [make_probe(), make_probe(hostname="gl-h2"), make_probe(hostname="gl-h3", torch="2.12.0")]
    hosts = ["h1", "h2", "h3"]
    recorded.write(tmp_path, probes, gate_result(slow_link="h2", slow_device="h3"), hosts)
    checks = recorded.read(tmp_path, 3)
    assert list(checks.probes) == ["gl-h1", "gl-h2", "gl-h3"]
    assert checks.hosts == hosts and checks.health == gate_result(slow_link="h2", slow_device="h3")

    page = render(_facts(checks=checks))
    links = page.split("<table id='health-links'>")[1].split("</table>")[0]
    named = re.findall(r"<tr class=named>(.*?)</tr>", links)
    assert len(named) == 2 and all("h2" in row for row in named), links  # its two pairs, not h3 – h1
    devices = page.split("<table id='health-devices'>")[1].split("</table>")[0]
    assert re.findall(r"<tr class=named><td>(h\d)</td>", devices) == ["h3"]
    assert "<td>0.100</td>" in devices and "<td>0.050</td>" in links
    findings = page.split("<ul id='health-findings'>")[1].split("</ul>")[0]
    assert findings.count("<li>") == 2 and "<li>h2: link" in findings and "<li>h3: " in findings
    parity = page.split("<pre id='parity'>")[1].split("</pre>")[0]
    assert "! torch: 2.13.0 on gl-h1, gl-h2; 2.12.0 on gl-h3" in parity, parity


def test_checks_that_did_not_run_are_said_in_words(tmp_path: Path) -> None:
    page = render(_facts(checks=recorded.read(tmp_path, 2)))
    assert "the job ran no health gate (--health-check)" in page
    assert "no probe of the hosts in the job record" in page


def test_checkpoints_and_hangs_are_marks_on_the_attempt_they_fell_in() -> None:
    saved = [
        {
            "step": 10,
            "checkpoint_stall_s": 0.25,
            "checkpoint_wait_s": 0.0,
            "checkpoint_mb": 72.4,
            "time": T0 + 20,
        },
        {
            "step": 20,
            "checkpoint_stall_s": 0.5,
            "checkpoint_wait_s": 0.0,
            "checkpoint_mb": 72.4,
            "time": T0 + 60,
        },
        {"step": 30, "checkpoint_mb": 72.4},  # an older trainer's record, without its time: left out
    ]
    hangs = [Mark(T0 + 30, "hang", "node 1: watchdog: no progress for 60 s"),
             Mark(T0 - 50, "hang", "before the job: on no attempt")]  # fmt: skip
    marks = [*checkpoints(saved), *hangs]
    assert marks[0].text == "checkpoint of step 10: 72 MB, the loop stalled 0.25 s"
    chart = render(_facts(marks=marks)).split('<div id="chart-attempts"')[1].split("</script>")[0]
    traces = {
        t["name"]: t
        for t in json.loads(re.search(r"Plotly.newPlot\([^,]+,\s*(\[.*?\]),\s*\{", chart).group(1))
    }
    assert traces["checkpoints"]["y"] == [
        "attempt 1",
        "attempt 2",
    ]  # T0+20 in attempt 1 (T0..T0+40), T0+60 in 2
    assert traces["hangs"]["y"] == ["attempt 1"] and traces["hangs"]["hovertext"] == [hangs[0].text]
