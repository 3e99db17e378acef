"""The scheduler protocol: where a job runs (TorchX's split of ``submit_dryrun`` and ``schedule``,
submitit's ``Job`` rebuilt from disk: ``state``/``logs``/``cancel`` find the job again from its record
alone, from any shell, long after ``submit`` returned)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, TypeVar

from pydantic import BaseModel

from gptlaunch.contract import Beat
from launcher.job.plan import Facts, Plan
from launcher.job.record import JobRecord, JobStatus
from launcher.job.spec import JobSpec

FactsT = TypeVar("FactsT", bound=Facts)


class Scheduler(Protocol[FactsT]):
    name: str
    # Whether the nodes see this machine's files at the same paths (local: yes; SLURM, SSH: not
    # necessarily). Checks of data paths and checkpoints run at submit only when they do.
    files_here: bool
    # Whether submit hands the job to a queue (SLURM): `launcher submit` then returns once the job is
    # accepted (--wait follows it); otherwise it follows the job to its end unless --detach.
    queued: bool

    def resolve(self, spec: JobSpec) -> FactsT:
        """The facts this submit depends on (free ports, allocation hosts, GPU slices, absolute
        workdir), recorded in the Plan. May probe the machine; starts nothing. Raises SpecError for
        what cannot run here."""
        ...

    def render(self, spec: JobSpec, facts: FactsT, job_id: str, job_dir: Path) -> Plan:
        """The Plan for ``spec`` with ``facts``. Pure: same inputs, same Plan."""
        ...

    def preflight(self, spec: JobSpec, plan: Plan, job_dir: Path) -> Plan:
        """Checks that run the Plan's machinery for a moment (e.g. a collective across the hosts):
        run by ``submit`` before the job record is written, never by ``render``/``--dry-run``.
        Returns the Plan to run: ``plan``, or one rendered again for ``job_dir`` on other nodes (a
        spare in place of a node the checks named). Raises SpecError naming what failed."""
        ...

    def submit(self, plan: Plan, record: JobRecord, *, detach: bool) -> BaseModel:
        """Start the Plan (or hand it to a queue) and return once it is started (or accepted), with the
        handle that finds it again, also saved in ``record``. ``detach``: the job must outlive this
        process; otherwise it stops (ranks checkpointing) if this process dies."""
        ...

    def state(self, record: JobRecord) -> JobStatus:
        """The job's status now; a terminal status never changes again."""
        ...

    def heartbeats(self, record: JobRecord) -> dict[int, list[Beat]]:
        """The latest beat of each rank of the running job (``gptlaunch.contract.Beat``), by node_rank,
        where they can be read; a node that cannot be reached is left out."""
        ...

    def logs(self, record: JobRecord, node: int | None, follow: bool) -> Iterator[str]:
        """Node-prefixed lines of the job's output (node ``node`` only, or all); with ``follow``, until
        the job reaches a terminal state."""
        ...

    def cancel(self, record: JobRecord, *, wait: bool = True) -> JobStatus:
        """Ask the job to stop: the ranks checkpoint and exit, and what has not exited after the job's
        grace period (seconds) is killed. ``wait``: return once it is over (bounded by about twice the
        grace period); else at once (asking again while a stop is under way stops the job at once,
        without waiting for checkpoints). Raises JobError when the job cannot be stopped from here."""
        ...
