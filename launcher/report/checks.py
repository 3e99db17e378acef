"""The report's sections on the checks before training (``launcher.preflight.recorded``): version
parity's classes of hosts, and the health gate's link and device tables with the hosts it names."""

from __future__ import annotations

import html
from collections.abc import Sequence

from launcher.preflight.health import GateSettings, findings
from launcher.preflight.parity import classes
from launcher.preflight.recorded import Checks


def parity(checks: Checks) -> str:
    """Do the hosts run the same versions? Their classes: what all share, then each field that
    differs with its values and hosts."""
    head = _head("Version parity", "Do the hosts run the same torch, CUDA, NCCL and packages?")
    if not checks.probes:
        return head + _missing(
            "no probe of the hosts in the job record: the scheduler runs none (local nodes share this "
            "machine), or the job has not reached its checks yet"
        )
    return f"{head}<pre id='parity'>{html.escape(classes(checks.probes))}</pre>\n"


def health(checks: Checks) -> str:
    """Which host is slow? The gate's pairwise links and each device's matmul throughput, with the
    hosts it names (with its default thresholds: a job's ``--min-busbw`` is not applied here)."""
    head = _head("Health check", "Is a host's link or device slower than the others'?")
    result = checks.health
    if result is None:
        return head + _missing("the job ran no health gate (--health-check), or it has not run yet")
    named = findings(result, checks.hosts, {}, GateSettings())
    slow = {check: {f.host for f in named if f.fatal and f.check == check} for check in ("link", "compute")}
    links = []
    for p in result.pairs:
        pair = [_host(checks.hosts, node) for node in p.nodes]
        cells = [str(p.round), " – ".join(pair), f"{p.busbw_gbs:.3f}", f"{p.time_us:.0f}"]
        links.append((bool(slow["link"] & set(pair)), cells))
    devices = [
        (_host(checks.hosts, d.node) in slow["compute"],
         [_host(checks.hosts, d.node), str(d.rank), d.device, d.kind, d.dtype, f"{d.tflops:.3f}"])
        for d in result.compute
    ]  # fmt: skip
    verdict = "".join(f"<li>{html.escape(f.line)}</li>" for f in named) or "<li>no host named</li>"
    device_columns = ["host", "rank", "device", "kind", "dtype", "TFLOP/s"]
    return (
        f"{head}<ul id='health-findings'>{verdict}</ul>"
        + _table("health-links", ["round", "pair", "busbw (GB/s)", "time (µs)"], links, "no pairwise stage")
        + _table("health-devices", device_columns, devices, "no compute stage")
    )


def _host(hosts: Sequence[str], node: int) -> str:
    return hosts[node] if node < len(hosts) else f"node {node}"


def _table(table_id: str, header: list[str], rows: list[tuple[bool, list[str]]], missing: str) -> str:
    """An HTML table; a row whose flag is set is marked ``named`` (the gate named its host for it)."""
    if not rows:
        return _missing(missing)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        f"<tr{' class=named' if flag else ''}>"
        + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        + "</tr>"
        for flag, cells in rows
    )
    return f"<table id='{table_id}'><tr>{head}</tr>{body}</table>\n"


def _head(title: str, question: str) -> str:
    slug = title.lower().replace(" ", "-")
    return f"<h2 id='{slug}'>{html.escape(title)}</h2><p class='why'>{html.escape(question)}</p>"


def _missing(text: str) -> str:
    return f"<p class='missing'>{html.escape(text)}</p>\n"
