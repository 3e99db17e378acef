"""A sweep's report page: every run's loss on one chart (training, then validation), and the runs
ranked by one metric. Made of the job report's parts (``launcher.report.page``: its style, plotly's
script inline, its sections), and written the same way, as ``SWEEP_DIR/report.html``."""

from __future__ import annotations

import html
from pathlib import Path

from gptlaunch.files import atomic_write_text
from launcher.report import charts
from launcher.report.facts import report_path
from launcher.report.page import document, section, summary_table, when
from launcher.report.sweep_facts import Ranked, RunFacts, SweepFacts, ranking
from launcher.sweep.points import describe

NO_LOSS = "no run has logged a {what} yet"
COLUMNS = ("rank", "run", "values", "state", "best {metric}", "step", "goodput", "job id")


def write(directory: Path, facts: SweepFacts, metric: str) -> Path:
    """Render ``facts`` into ``directory/report.html`` (the sweep's directory), its runs ranked by
    ``metric``; returns its path. Raises OSError when it cannot be written."""
    path = report_path(directory)
    atomic_write_text(path, render(facts, metric))
    return path


def render(facts: SweepFacts, metric: str) -> str:
    """The whole page, as text."""
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
            _table(ranked, metric),
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


def _table(ranked: list[Ranked], metric: str) -> str:
    """The ranking, one row per run; a cell's title says more where there is more (the step of the
    best value, why a run failed)."""
    head = "".join(f"<th>{html.escape(c.format(metric=metric))}</th>" for c in COLUMNS)
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
