"""The scheduler protocol: resolve (may probe the environment), render (pure), launch, cancel."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from launcher.jobs import JobRecord, JobStatus
from launcher.plan import Plan
from launcher.spec import JobSpec


class Scheduler(Protocol):
    name: str

    def resolve(self, spec: JobSpec) -> JobSpec:
        """Fill in what depends on the environment (free ports, allocation hosts). May probe; never
        starts anything."""
        ...

    def render(self, spec: JobSpec, job_id: str, job_dir: Path) -> Plan:
        """The Plan for a resolved spec. Pure: same inputs, same Plan."""
        ...

    def launch(self, plan: Plan, record: JobRecord) -> JobStatus:
        """Start the Plan's processes and follow the job to its end; returns the final status."""
        ...

    def cancel(self, record: JobRecord) -> JobStatus:
        """Stop a running job: SIGTERM (the ranks checkpoint), SIGKILL after the job's grace period."""
        ...
