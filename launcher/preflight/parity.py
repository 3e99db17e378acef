"""Version parity across hosts: compare the probes of a job's hosts (``launcher.preflight.probe``).

Ranks on hosts with a different torch, NCCL or tokenizer do not fail cleanly: they hang in a
collective, or train on different tokens. So before a multi-host job starts, the fields in
MUST_MATCH must be equal on every host, and when the hosts have GPUs each needs as many as the job
runs processes per node. Everything else in a probe (hostname, OS, kernel, driver, interfaces) is
shown, never enforced: a different kernel or a newer driver works.

Pure functions over Probe models; imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from launcher.job.measurements import Probe
from launcher.preflight.probe import KEY_PACKAGES, describe_gpus

MUST_MATCH: tuple[str, ...] = (
    "python",
    "torch",
    "torch_git",
    "cuda",
    "nccl",
    "cudnn",
    "launcher",
    "image_digest",
    *(f"packages.{name}" for name in KEY_PACKAGES),
)
# Rows of report_table, must-match fields among them (torch_git shortened for the eye).
TABLE_FIELDS: tuple[str, ...] = (
    "hostname",
    "os",
    "python",
    "torch",
    "torch_git",
    "cuda",
    "nccl",
    "cudnn",
    "driver",
    "gpus",
    "launcher",
    *(f"packages.{name}" for name in KEY_PACKAGES),
    "image_digest",
)
WIDE_TABLE_MAX_HOSTS = 8  # beyond this, one column per host no longer fits a terminal: classes instead
MAX_RUNS = 8  # runs of host names shown in one group (gl-h1..gl-h12, gl-h14, …); beyond, a count
_FIX_VERSIONS = "install the same versions on every host (or run the same container image)"
_FIX_GPUS = "use hosts with enough GPUs, or run fewer processes per node"
_SKIP = "--skip-parity launches anyway"
_LEGEND = "! differs, must match (the launch is refused)   ~ differs, shown only"


def field_value(probe: Probe, field: str) -> str | None:
    """The value of ``field`` (a Probe field, or ``packages.NAME``) as text; None when absent."""
    if field.startswith("packages."):
        return probe.packages.get(field.removeprefix("packages."))
    if field == "gpus":
        return describe_gpus(probe.gpus, memory=False)
    value = getattr(probe, field)
    return None if value is None else str(value)


def _runs(hosts: list[str]) -> list[list[str]]:
    """``hosts`` cut into runs of names that differ only in a trailing number counting up by one
    (gl-h1, gl-h2, gl-h3; n08, n09, n10), in the given order."""
    runs: list[list[str]] = []
    for host in hosts:
        if runs:
            match = re.fullmatch(r"(.*?)(\d+)", runs[-1][-1])
            if match is not None:
                prefix, digits = match.groups()
                following = str(int(digits) + 1)
                if host in (prefix + following, prefix + following.zfill(len(digits))):
                    runs[-1].append(host)
                    continue
        runs.append([host])
    return runs


def host_ranges(hosts: list[str]) -> str:
    """``hosts`` as runs: "gl-h1..gl-h12, gl-h14, gl-h15" (a run of three or more as first..last);
    beyond MAX_RUNS runs, "… and N more host(s)"."""
    runs = _runs(hosts)
    shown = [", ".join(run) if len(run) < 3 else f"{run[0]}..{run[-1]}" for run in runs[:MAX_RUNS]]
    rest = sum(len(run) for run in runs[MAX_RUNS:])
    return ", ".join(shown) + (f", … and {rest} more host(s)" if rest else "")


def group_by_value(field: str, values: dict[str, str | None]) -> str:
    """E.g. "2.13.0 on h1, h3; 2.12.0 on h2": each value with its hosts, the most common value first
    (ties in host order), "(not installed)" or "(none)" for None."""
    absent = "(not installed)" if field == "torch" or field.startswith("packages.") else "(none)"
    groups: dict[str | None, list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    ordered = sorted(groups.items(), key=lambda item: -len(item[1]))  # stable: ties keep host order
    return "; ".join(f"{absent if v is None else v} on {host_ranges(hosts)}" for v, hosts in ordered)


@dataclass(frozen=True)
class Mismatch:
    """A must-match field that differs across hosts: host -> its value (None when absent)."""

    field: str
    values: dict[str, str | None]

    def describe(self) -> str:
        return f"{self.field}: {group_by_value(self.field, self.values)}"


@dataclass(frozen=True)
class Shortfall:
    """A host with fewer GPUs than the job's processes per node."""

    host: str
    need_gpus: int
    have_gpus: int

    def describe(self) -> str:
        return f"gpus: {self.host} has {self.have_gpus}, the job runs {self.need_gpus} process(es) per node"


def compare(probes: dict[str, Probe], gpus_per_node: int) -> tuple[list[Mismatch], list[Shortfall]]:
    """The must-match fields that differ (in MUST_MATCH order, hosts in ``probes`` order) and the hosts
    with fewer than ``gpus_per_node`` GPUs. GPUs are required only if some host has one: on hosts
    without GPUs a job's processes per node are CPU processes."""
    mismatches = []
    for field in MUST_MATCH:
        values = {host: field_value(probe, field) for host, probe in probes.items()}
        if len(set(values.values())) > 1:
            mismatches.append(Mismatch(field, values))
    shortfalls = []
    if any(probe.gpus for probe in probes.values()):
        shortfalls = [
            Shortfall(host, gpus_per_node, len(probe.gpus))
            for host, probe in probes.items()
            if len(probe.gpus) < gpus_per_node
        ]
    return mismatches, shortfalls


def diff_text(mismatches: list[Mismatch], shortfalls: list[Shortfall]) -> str:
    """What to print when refusing a launch: a header, one line per difference, and the fix."""
    counts, fixes = [], []
    if mismatches:
        counts.append(f"{len(mismatches)} field(s) differ across hosts")
        fixes.append(_FIX_VERSIONS)
    if shortfalls:
        counts.append(f"{len(shortfalls)} host(s) have too few GPUs")
        fixes.append(_FIX_GPUS)
    lines = [f"version parity check failed: {'; '.join(counts)}"]
    lines += [f"  {m.describe()}" for m in mismatches] + [f"  {s.describe()}" for s in shortfalls]
    lines.append(f"{'; '.join([*fixes, _SKIP])}")
    return "\n".join(lines)


def report_table(probes: dict[str, Probe]) -> str:
    """The probes side by side, one column per host; over WIDE_TABLE_MAX_HOSTS hosts, ``classes``
    instead. A field that differs is marked in the first column: "!" must match (the launch is
    refused), "~" shown only; the hostname is never marked."""
    if len(probes) > WIDE_TABLE_MAX_HOSTS:
        return classes(probes)
    rows: list[list[str]] = []
    for field in TABLE_FIELDS:
        values = {host: field_value(probe, field) for host, probe in probes.items()}
        differs = len(set(values.values())) > 1 and field != "hostname"
        mark = ("!" if field in MUST_MATCH else "~") if differs else " "
        rows.append([f"{mark} {field}", *(_cell(field, v) for v in values.values())])
    return _align([["  field", *probes], *rows]) + "\n" + _LEGEND


def classes(probes: dict[str, Probe]) -> str:
    """The hosts as equivalence classes: one line with what every host shares ("16 hosts gl-h1..gl-h16
    alike: python 3.11.2, torch 2.13.0, …"), then, for each field that differs, its values with their
    hosts ("! packages.numpy: 2.4.6 on gl-h1..gl-h12, gl-h14..gl-h16; 2.3.1 on gl-h13")."""
    shared, differing = [], []
    for field in TABLE_FIELDS[1:]:  # not the hostname
        values = {host: field_value(probe, field) for host, probe in probes.items()}
        if len(set(values.values())) > 1:
            mark = "!" if field in MUST_MATCH else "~"
            differing.append(f"{mark} {field}: {group_by_value(field, values)}")
        elif (value := next(iter(values.values()))) is not None:
            shared.append(f"{field} {_cell(field, value)}")
    alike = "alike in" if differing else "alike"
    head = f"{len(probes)} host(s) {host_ranges(list(probes))} {alike}: {', '.join(shared)}"
    return "\n".join([head, *differing, *([_LEGEND] if differing else [])])


def _cell(field: str, value: str | None) -> str:
    if field == "torch_git" and value:
        return value[:12]
    return "-" if value is None else value


def _align(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
