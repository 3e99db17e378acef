"""Version parity across hosts: compare the probes of a job's hosts (``launcher.preflight.probe``).

Ranks on hosts with a different torch, NCCL or tokenizer do not fail cleanly: they hang in a
collective, or train on different tokens. So before a multi-host job starts, the fields in
MUST_MATCH must be equal on every host, and when the hosts have GPUs each needs as many as the job
runs processes per node. Everything else in a probe (hostname, OS, kernel, driver, interfaces) is
shown, never enforced: a different kernel or a newer driver works.

Pure functions over Probe models; imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from launcher.preflight.probe import KEY_PACKAGES, Probe, describe_gpus

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
WIDE_TABLE_MAX_HOSTS = 8  # beyond this, one column per host no longer fits a terminal
_LIST_MAX_HOSTS = 5  # hosts named in full in one group of a grouped value; beyond, a count
_FIX_VERSIONS = "install the same versions on every host (or run the same container image)"
_FIX_GPUS = "use hosts with enough GPUs, or run fewer processes per node"
_SKIP = "--skip-parity launches anyway"


def field_value(probe: Probe, field: str) -> str | None:
    """The value of ``field`` (a Probe field, or ``packages.NAME``) as text; None when absent."""
    if field.startswith("packages."):
        return probe.packages.get(field.removeprefix("packages."))
    if field == "gpus":
        return describe_gpus(probe.gpus, memory=False)
    value = getattr(probe, field)
    return None if value is None else str(value)


def _absent(field: str) -> str:
    return "(not installed)" if field == "torch" or field.startswith("packages.") else "(none)"


def _hosts(hosts: list[str]) -> str:
    if len(hosts) <= _LIST_MAX_HOSTS:
        return ", ".join(hosts)
    return f"{len(hosts)} hosts ({', '.join(hosts[:3])}, … {len(hosts) - 3} more)"


def group_by_value(field: str, values: dict[str, str | None]) -> str:
    """E.g. "2.13.0 on h1, h3; 2.12.0 on h2": each value with its hosts, the most common value first
    (ties in host order), "(not installed)" or "(none)" for None."""
    groups: dict[str | None, list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    ordered = sorted(groups.items(), key=lambda item: -len(item[1]))  # stable: ties keep host order
    return "; ".join(f"{_absent(field) if v is None else v} on {_hosts(hosts)}" for v, hosts in ordered)


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


def diff_text(mismatches: Iterable[Mismatch], shortfalls: Iterable[Shortfall]) -> str:
    """What to print when refusing a launch: a header, one line per difference, and the fix."""
    mismatches, shortfalls = list(mismatches), list(shortfalls)
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
    """The probes side by side, one column per host (one line per field with the values grouped when
    there are over WIDE_TABLE_MAX_HOSTS hosts). A field that differs is marked in the first column:
    "!" must match (the launch is refused), "~" shown only; the hostname is never marked."""
    rows: list[list[str]] = []
    for field in TABLE_FIELDS:
        values = {host: field_value(probe, field) for host, probe in probes.items()}
        differs = len(set(values.values())) > 1 and field != "hostname"
        mark = ("!" if field in MUST_MATCH else "~") if differs else " "
        if len(probes) > WIDE_TABLE_MAX_HOSTS and field == "hostname":
            cells = [_hosts([str(v) for v in values.values()])]
        elif len(probes) > WIDE_TABLE_MAX_HOSTS:
            cells = [group_by_value(field, values) if differs else _cell(field, next(iter(values.values())))]
        else:
            cells = [_cell(field, v) for v in values.values()]
        rows.append([f"{mark} {field}", *cells])
    header = ["  field", *(list(probes) if len(probes) <= WIDE_TABLE_MAX_HOSTS else [f"{len(probes)} hosts"])]
    legend = "! differs, must match (the launch is refused)   ~ differs, shown only"
    return _align([header, *rows]) + "\n" + legend


def _cell(field: str, value: str | None) -> str:
    if field == "torch_git" and value:
        return value[:12]
    return "-" if value is None else value


def _align(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
