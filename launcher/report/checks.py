"""The report's parts on the checks before training (``launcher.preflight.recorded``): version
parity's classes of hosts, and the health gate's link and device tables with the hosts it names.
Each returns its HTML, or None when the job record holds no such check (the page says so)."""

from __future__ import annotations

import html
from collections.abc import Sequence

from launcher.preflight.health import GateSettings, findings
from launcher.preflight.parity import classes
from launcher.preflight.recorded import Checks

PARITY_MISSING = (
    "no probe of the hosts in the job record: the scheduler runs none (local nodes share this machine), "
    "or the job has not reached its checks yet"
)
HEALTH_MISSING = "the job ran no health gate (--health-check), or it has not run yet"


def parity(checks: Checks) -> str | None:
    """The hosts' classes: what all share, then each field that differs with its values and hosts."""
    if not checks.probes:
        return None
    return f"<pre id='parity'>{html.escape(classes(checks.probes))}</pre>"


def health(checks: Checks, gpus_per_node: int) -> str | None:
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
