"""The report page (``docs/report.md``): one HTML file, a job's (``render``) or a sweep's
(``render_sweep``), written atomically (a reader sees a whole page or the previous one)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from gptlaunch.files import atomic_write_text
from launcher.preflight.health import GateSettings, findings
from launcher.preflight.parity import classes
from launcher.preflight.recorded import Checks
from launcher.report import charts
from launcher.report.facts import Facts, report_path
from launcher.sweep.points import describe
from launcher.sweep.table import Ranked, RunFacts, SweepFacts, ranking

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; }
table { border-collapse: collapse; } td, th { padding: 2px 12px 2px 0; text-align: left; }
p.missing { color: #666; font-style: italic; } .why { color: #555; }
tr.named td { color: #d62728; font-weight: bold; } pre { background: #f6f6f6; padding: 8px; }
"""

RANKS_UNLOGGED = "the metrics carry no per-rank times (the built-in trainer's straggler check logs them)"
RANKS_UNRECORDED = (
    "the launcher recorded no rank's compute time yet (every 15 s while the ranks beat into the job "
    "record; on SSH hosts, at each attempt's end)"
)
PARITY_MISSING = (
    "no probe of the hosts in the job record: the scheduler runs none (local nodes share this machine), "
    "or the job has not reached its checks yet"
)
HEALTH_MISSING = "the job ran no health gate (--health-check), or it has not run yet"
NO_LOSS = "no run has logged a {what} yet"
RANKING_COLUMNS = ("rank", "run", "values", "state", "best {metric}", "step", "goodput", "job id")


def write(directory: Path, page: str) -> Path:
    """Write ``page`` (``render``'s or ``render_sweep``'s) into ``directory/report.html`` (the job's
    record, or the sweep's directory); returns its path. Raises OSError when it cannot be written."""
    path = report_path(directory)
    atomic_write_text(path, page)
    return path


def render(facts: Facts) -> str:
    """The whole page, as text."""
    metrics = facts.metrics or []
    sections = [
        section(
            "Loss",
            "Is the model learning, and did a retry go on from where the failed attempt was?",
            charts.loss(metrics, facts.spans),
            facts.metrics_note or "no loss was logged yet",
        ),
        section(
            "Each rank's throughput",
            "Is one rank slower than the others (a straggler sets the pace of all)?",
            # The trainer's own numbers where it logged them, else the launcher's, of any program.
            charts.rank_throughput(metrics) or charts.rank_compute(facts.rank_compute),
            f"{facts.metrics_note or RANKS_UNLOGGED}, and {RANKS_UNRECORDED}",
        ),
        section(
            "Attempts",
            "When did each attempt run, how did it end and why; when were checkpoints saved and hangs found?",
            charts.timeline(facts.spans, facts.marks, facts.made_at),
            "the job has not started yet",
        )
        + _attempts(facts),
        section(
            "Where the wall time went",
            "How much of the wall time trained, and what took the rest?",
            charts.goodput_bar(facts.goodput) if facts.goodput is not None else None,
            "no rank has reported yet: goodput needs the ranks' heartbeats",
        ),
        section(
            "Health check",
            "Is a host's link or device slower than the others'?",
            _health(facts.checks, facts.plan.nproc_per_node),
            HEALTH_MISSING,
        ),
        section(
            "Version parity",
            "Do the hosts run the same torch, CUDA, NCCL and packages?",
            f"<pre id='parity'>{html.escape(classes(facts.checks.probes))}</pre>"
            if facts.checks.probes
            else None,
            PARITY_MISSING,
        ),
    ]
    body = f"{_summary(facts)}\n{''.join(sections)}\n{_files(facts)}"
    return document(f"{facts.plan.job_id}: report", body)


def document(title: str, body: str) -> str:
    """A whole page of ``body`` (HTML) under ``title`` (text), with the style and plotly's script
    inline: it opens from disk with no network."""
    return (
        f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style>"
        f"<script>{get_plotlyjs()}</script></head><body>\n{body}\n</body></html>\n"
    )


def _summary(facts: Facts) -> str:
    st, plan = facts.status, facts.plan
    ended = f" (exit code {st.job_exit_code}: {st.message or st.state})" if st.state.is_terminal else ""
    rows = [
        ("state", f"{st.state}{ended}"),
        ("scheduler", f"{plan.scheduler}, {plan.nnodes} node(s) × {plan.nproc_per_node}"),
        ("run dir", plan.run_dir),
        ("attempts", str(len(facts.spans))),
        ("goodput", facts.goodput.describe() if facts.goodput is not None else "not known yet"),
        ("report made", when(facts.made_at)),
    ]
    return f"<h1>Job {html.escape(plan.job_id)}</h1>{summary_table(rows)}"


def summary_table(rows: list[tuple[str, str]]) -> str:
    """The page's head: one (name, text) per row."""
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table id='summary'>{cells}</table>"


def section(title: str, question: str, figure: go.Figure | str | None, missing: str) -> str:
    """A part of the page: its title, the question it answers, and its chart or HTML (``missing``, in
    words, when None). A chart's div is ``chart-SLUG``, SLUG the title in lower case, dashed."""
    slug = title.lower().replace(" ", "-").replace("'", "")
    head = f"<h2 id='{slug}'>{html.escape(title)}</h2><p class='why'>{html.escape(question)}</p>"
    if figure is None:
        return f"{head}<p class='missing'>{html.escape(missing)}</p>\n"
    if isinstance(figure, str):
        return f"{head}{figure}\n"
    body = figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"chart-{slug}",
                          config={"displaylogo": False, "responsive": True})  # fmt: skip
    return f"{head}{body}\n"


def _attempts(facts: Facts) -> str:
    items = "".join(f"<li>{html.escape(charts.describe(span))}</li>" for span in facts.spans)
    return f"<ul id='attempts'>{items}</ul>" if items else ""


def _files(facts: Facts) -> str:
    if not facts.files:
        return "<h2 id='files'>Logs</h2><p class='missing'>no node log in the job record yet</p>"
    items = "".join(
        f"<li><a href='{html.escape(path)}'>{html.escape(label)}</a></li>" for label, path in facts.files
    )
    return f"<h2 id='files'>Logs and hang stacks</h2><ul>{items}</ul>"


def when(epoch_s: float) -> str:
    """``2026-11-28 07:19:00 UTC`` of ``epoch_s`` (seconds)."""
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _health(checks: Checks, gpus_per_node: int) -> str | None:
    """The gate's verdict (with its default thresholds: a job's ``--min-busbw`` is not applied here),
    its pairwise links and each rank's matmul throughput; the rows of a host named for them marked."""
    result = checks.health
    if result is None:
        return None
    named = findings(result, checks.hosts, {}, GateSettings(gpus_per_node=gpus_per_node))
    slow = {check: {f.host for f in named if f.fatal and f.check == check} for check in ("link", "compute")}
    links = []
    for p in result.pairs:
        pair = [_host(checks.hosts, node) for node in p.nodes]
        cells = [str(p.round + 1), " – ".join(pair), f"{p.busbw_gbs:.3f}", f"{p.time_us:.0f}"]
        links.append((bool(slow["link"] & set(pair)), cells))
    devices = [
        (_host(checks.hosts, d.node) in slow["compute"],
         [_host(checks.hosts, d.node), str(d.rank), d.device, d.kind, d.dtype, f"{d.tflops:.3f}"])
        for d in result.compute
    ]  # fmt: skip
    lines = [f.line if f.fatal else f"warning: {f.line}" for f in named] or ["no host named"]
    verdict = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    device_columns = ["host", "rank", "device", "kind", "dtype", "TFLOP/s"]
    return (
        f"<ul id='health-findings'>{verdict}</ul>"
        + _table("health-links", ["round", "pair", "busbw (GB/s)", "time (µs)"], links, "no pairwise stage")
        + _table("health-devices", device_columns, devices, "no compute stage")
    )


def _host(hosts: Sequence[str], node: int) -> str:
    return hosts[node] if node < len(hosts) else f"node {node}"


def _table(table_id: str, header: list[str], rows: list[tuple[bool, list[str]]], missing: str) -> str:
    """An HTML table; a row whose flag is set is marked ``named`` (the gate named its host for it)."""
    if not rows:
        return f"<p class='missing'>{html.escape(missing)}</p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        f"<tr{' class=named' if flag else ''}>"
        + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        + "</tr>"
        for flag, cells in rows
    )
    return f"<table id='{table_id}'><tr>{head}</tr>{body}</table>"


def render_sweep(facts: SweepFacts, metric: str) -> str:
    """A sweep's whole page, as text: its runs ranked by ``metric``."""
    train = [(describe(r.values), charts.training_loss(r.metrics or [])) for r in facts.runs]
    val = [(describe(r.values), charts.validation_loss(r.metrics or [])) for r in facts.runs]
    ranked = ranking(facts.runs, metric)
    sections = [
        section(
            "Training loss",
            "Which runs learn, and which diverge or stall?",
            charts.overlay("Training loss", "loss (nats)", train),
            NO_LOSS.format(what="training loss") + _notes(facts.runs),
        ),
        section(
            "Validation loss",
            "Which runs generalize best, and when did each stop improving?",
            charts.overlay("Validation loss", "loss (nats)", val, markers=True),
            NO_LOSS.format(what="validation loss") + _notes(facts.runs),
        ),
        section(
            "Ranking",
            f"Which run is best by {metric} (its lowest value in the run's metrics.jsonl; lower is better)?",
            _ranking(ranked, metric),
            "",
        ),
    ]
    head = [
        ("runs", f"{len(facts.runs)}: {facts.states}"),
        ("scheduler", facts.scheduler),
        ("best", _best(ranked, metric)),
        ("report made", when(facts.made_at)),
    ]
    body = f"<h1>Sweep {html.escape(facts.sweep_id)}</h1>{summary_table(head)}\n{''.join(sections)}"
    return document(f"{facts.sweep_id}: report", body)


def _best(ranked: list[Ranked], metric: str) -> str:
    top = ranked[0] if ranked else None
    if top is None or top.best is None:
        return f"no run has logged {metric} yet"
    return f"run {top.run.index} ({describe(top.run.values)}): {metric} {top.best.value:.4f}"


def _notes(runs: list[RunFacts]) -> str:
    """Why runs have no metrics, once per reason: ``: run 1: REASON``."""
    notes: dict[str, list[int]] = {}
    for run in runs:
        if not run.metrics:
            notes.setdefault(run.metrics_note or f"the run is {run.state}", []).append(run.index)
    said = "; ".join(f"run {', '.join(map(str, ks))}: {note}" for note, ks in notes.items())
    return f" ({said})" if said else ""


def _ranking(ranked: list[Ranked], metric: str) -> str:
    """The ranking, one row per run; a cell's title says more where there is more (the step of the
    best value, why a run failed)."""
    head = "".join(f"<th>{html.escape(c.format(metric=metric))}</th>" for c in RANKING_COLUMNS)
    rows = []
    for r in ranked:
        run = r.run
        best = "-" if r.best is None else f"{r.best.value:.4f}"
        at = "" if r.best is None else f"at step {r.best.step:,}"
        cells = [
            ("rank", "-" if r.rank is None else str(r.rank), ""),
            ("run", str(run.index), ""),
            ("values", describe(run.values), ""),
            ("state", run.state, run.error or ""),
            ("best", best, at),
            ("step", "-" if run.step is None else f"{run.step:,}", ""),
            ("goodput", "-" if run.goodput is None else f"{run.goodput:.0%}", ""),
            ("job", run.job_id, ""),
        ]
        rows.append("<tr>" + "".join(_cell(*cell) for cell in cells) + "</tr>")
    return f"<table id='ranking'><tr>{head}</tr>{''.join(rows)}</table>"


def _cell(kind: str, text: str, title: str) -> str:
    hover = f" title='{html.escape(title)}'" if title else ""
    return f"<td class='{kind}'{hover}>{html.escape(text)}</td>"
