"""Job records: one directory per job holding the spec, the Plan, per-node logs and the status.

Every file is written atomically (temporary file, fsync, rename), so a reader or a crash never sees
a half-written record.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from launcher.plan import Plan
from launcher.spec import JobSpec
from trainer.fsutil import atomic_write_text

JobState = Literal["running", "succeeded", "failed", "cancelled", "checkpointed", "unknown"]
FINAL_STATES = ("succeeded", "failed", "cancelled", "checkpointed", "unknown")


class JobNotFound(LookupError):
    """No job record by that id or path."""


class Failure(BaseModel):
    """The root cause of a failed job: the first rank that failed and its error."""

    model_config = ConfigDict(extra="forbid")
    node_rank: int
    rank: int | None = None
    local_rank: int | None = None
    exit_code: int | None = None
    error: str = ""

    def summary(self) -> str:
        who = f"node {self.node_rank}"
        if self.rank is not None:
            who += f", rank {self.rank}"
        if self.local_rank is not None:
            who += f" (local_rank {self.local_rank})"
        return f"{who} failed: {self.error}"


class JobStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")
    state: JobState = "running"
    exit_code: int | None = None
    launcher_pid: int | None = None
    launcher_started: float | None = None  # process create time: tells a reused pid apart
    node_pids: list[int] = []
    started_at: float = 0.0
    ended_at: float | None = None
    failure: Failure | None = None
    message: str = ""


def new_job_id(name: str) -> str:
    """``<name>-<UTC yyyymmdd-hhmmss>-<6 hex>``: sortable by time and unique."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


class JobRecord:
    """The directory of one job."""

    def __init__(self, path: Path) -> None:
        self.dir = path

    @property
    def job_id(self) -> str:
        return self.plan().job_id

    @classmethod
    def create(cls, path: Path, spec: JobSpec, plan: Plan) -> JobRecord:
        """Make the record of a new job. Raises FileExistsError if ``path`` already holds a job."""
        path.mkdir(parents=True, exist_ok=True)
        if (path / "plan.json").exists():
            raise FileExistsError(f"{path} already holds a job record: choose another --job-dir")
        rec = cls(path)
        atomic_write_text(path / "spec.json", spec.model_dump_json(indent=2))
        atomic_write_text(path / "plan.json", plan.to_json())  # written last: it marks a complete record
        return rec

    @classmethod
    def open(cls, ref: str, jobs_root: Path) -> JobRecord:
        """A job by id (under ``jobs_root``) or by directory path. Raises JobNotFound."""
        for path in (jobs_root / ref, Path(ref)):
            if (path / "plan.json").is_file():
                return cls(path)
        raise JobNotFound(f"no job {ref!r} in {jobs_root} (see `launcher list`, or pass the job directory)")

    def spec(self) -> JobSpec:
        return JobSpec.model_validate_json((self.dir / "spec.json").read_text())

    def plan(self) -> Plan:
        return Plan.model_validate_json((self.dir / "plan.json").read_text())

    def status(self) -> JobStatus | None:
        path = self.dir / "status.json"
        return JobStatus.model_validate_json(path.read_text()) if path.is_file() else None

    def write_status(self, status: JobStatus) -> None:
        atomic_write_text(self.dir / "status.json", status.model_dump_json(indent=2))

    def node_log(self, node_rank: int) -> Path:
        return self.dir / f"node-{node_rank}.log"

    def torchelastic_dir(self, node_rank: int) -> Path:
        return self.dir / "torchelastic" / f"node-{node_rank}"


def shown_state(status: JobStatus | None) -> str:
    """The state to show: "lost" for a job recorded as running whose launcher is gone (killed, or
    its machine rebooted); `launcher cancel` stops what is left of it."""
    from launcher.procs import launcher_process

    if status is None:
        return "created"
    if status.state == "running" and launcher_process(status.launcher_pid, status.launcher_started) is None:
        return "lost"
    return status.state


def list_jobs(jobs_root: Path) -> list[JobRecord]:
    """Complete job records under ``jobs_root``, oldest first."""
    if not jobs_root.is_dir():
        return []
    found = [JobRecord(p) for p in jobs_root.iterdir() if (p / "plan.json").is_file()]
    return sorted(found, key=lambda r: (r.dir / "plan.json").stat().st_mtime)
