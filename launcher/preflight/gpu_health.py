"""GPU health for the health gate, from ``nvidia-smi --query-gpu=… --format=csv`` on every host.

``query()`` runs on each host (rank ``local_rank`` 0 of the collective preflight) and returns the raw
CSV, which travels to the launcher; ``parse`` and ``judge`` read it there (pure, no torch), so a
recorded output is a test fixture. What names a host, each with the line that says why, is in
``_gpu_issues`` (fields as nvidia-smi calls them, see ``nvidia-smi --help-query-gpu``) and ``judge``;
``persistence_mode`` Disabled is a warning only: it slows start-up, not training.
"""

from __future__ import annotations

import shutil
import subprocess

FIELDS = (
    "index",
    "name",
    "pci.bus_id",
    "persistence_mode",
    "temperature.gpu",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "clocks_event_reasons.active",
)
# Drivers before 535 know the clock reasons by their older name.
LEGACY_FIELDS = {"clocks_event_reasons.active": "clocks_throttle_reasons.active"}
MAX_TEMP_C = 85.0  # NVIDIA datacenter GPUs start slowing down at about 85-90 °C
QUERY_TIMEOUT_S = 20.0
# NVML's clock event reasons that mean the GPU is held below its clocks by a fault or by heat
# (nvml.h: nvmlClocksEventReason*); power capping (0x4) and idling (0x1) are normal.
SLOWDOWN_BITS = {
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake slowdown",
}


def query() -> str | None:
    """The CSV of ``nvidia-smi --query-gpu`` with FIELDS (a header line, one row per GPU); None where
    there is no nvidia-smi; ``error: …`` when it fails. Retries with LEGACY_FIELDS' names when the
    driver does not know a field."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return None
    out = ""
    for fields in (FIELDS, tuple(LEGACY_FIELDS.get(f, f) for f in FIELDS)):
        argv = [nvidia_smi, f"--query-gpu={','.join(fields)}", "--format=csv,nounits"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"error: {' '.join(argv)}: {e}"
        out = (done.stdout + done.stderr).strip()
        if done.returncode == 0:
            return done.stdout
        if "not a valid field" not in out:
            break
    return f"error: nvidia-smi --query-gpu: {out.splitlines()[-1] if out else 'no output'}"


def parse(text: str) -> list[dict[str, str]]:
    """The rows of ``nvidia-smi --query-gpu … --format=csv[,nounits]`` output as field -> value,
    keyed by the header's names without their units (``temperature.gpu [C]`` -> ``temperature.gpu``;
    a legacy name -> its FIELDS name). Raises ValueError for text that is not such a table."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines or "index" not in lines[0]:
        raise ValueError(f"not nvidia-smi --query-gpu CSV output: {text.strip()[:200]!r}")
    legacy = {old: new for new, old in LEGACY_FIELDS.items()}
    names = [h.strip().split(" [")[0] for h in lines[0].split(",")]
    names = [legacy.get(n, n) for n in names]
    rows = []
    for line in lines[1:]:
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(names):
            raise ValueError(f"nvidia-smi row has {len(values)} fields, the header {len(names)}: {line!r}")
        rows.append(dict(zip(names, values, strict=True)))
    return rows


# One unhealthy field of one GPU, or of the host's set of GPUs: its line (after the host's name) and
# whether it refuses the launch (False: a warning only).
Issue = tuple[str, bool]


def _issue(index: str | None, field: str, value: str, why: str, fatal: bool = True) -> Issue:
    gpu = f"gpu {index} " if index is not None else "gpus: "
    return f"{gpu}{field} {value}: {why}", fatal


def _number(value: str) -> float | None:
    """The field's number (hex for a bit mask); None for anything else ("[N/A]", "[Not Supported]")."""
    try:
        return float(int(value, 16)) if value.lower().startswith("0x") else float(value)
    except ValueError:
        return None


def _gpu_issues(row: dict[str, str]) -> list[Issue]:
    index = row.get("index", "?")
    issues = []
    ecc_field = "ecc.errors.uncorrected.volatile.total"
    ecc = _number(row.get(ecc_field, ""))
    if ecc:
        issues.append(_issue(index, ecc_field, f"{ecc:g}", "uncorrectable memory errors"))
    for field, why in (
        ("retired_pages.pending", "a page retirement waits for a GPU reset"),
        ("remapped_rows.pending", "a row remap waits for a GPU reset"),
        ("remapped_rows.failure", "the GPU has no spare rows left: replace it"),
    ):
        if row.get(field, "").lower() == "yes":
            issues.append(_issue(index, field, "Yes", why))
    reasons = _number(row.get("clocks_event_reasons.active", ""))
    slow = [name for bit, name in SLOWDOWN_BITS.items() if reasons is not None and int(reasons) & bit]
    if slow:
        value = row["clocks_event_reasons.active"]
        issues.append(_issue(index, "clocks_event_reasons.active", value, ", ".join(slow)))
    temperature = _number(row.get("temperature.gpu", ""))
    if temperature is not None and temperature >= MAX_TEMP_C:
        issues.append(_issue(index, "temperature.gpu", f"{temperature:g} C", f"at or above {MAX_TEMP_C:g} C"))
    if row.get("persistence_mode", "").lower() == "disabled":
        why = "each process start re-initialises the driver (`nvidia-smi -pm 1` as root)"
        issues.append(_issue(index, "persistence_mode", "Disabled", why, fatal=False))
    return issues


def judge(rows: list[dict[str, str]], gpus_per_node: int) -> list[Issue]:
    """What is unhealthy about one host's GPUs (``parse``'s rows): each GPU's fields, then the count
    against ``gpus_per_node`` and the models (one per host)."""
    issues = [issue for row in rows for issue in _gpu_issues(row)]
    if len(rows) < gpus_per_node:
        why = f"the job runs {gpus_per_node} process(es) per node"
        issues.append(_issue(None, "count", str(len(rows)), why))
    models = sorted({row.get("name", "?") for row in rows})
    if len(models) > 1:
        issues.append(_issue(None, "name", " / ".join(models), "more than one GPU model on the host"))
    return issues
