"""Following a job from its record: its node logs until it ends, or its end within a time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from launcher.job.logs import tail
from launcher.job.record import JobRecord, JobStatus


class HasState(Protocol):
    """What tells a job's status now (a scheduler)."""

    def state(self, record: JobRecord) -> JobStatus: ...


def node_logs(scheduler: HasState, record: JobRecord, node: int | None, follow: bool) -> Iterator[str]:
    """A scheduler's ``logs`` when its nodes write ``node-<k>.log`` in the job record: the lines
    as ``<label> | line`` (``NodePlan.label``, of the plan when each log was opened: a replaced host's
    spare is named), with ``follow`` until ``scheduler.state`` is terminal."""
    nodes = [n for n in record.plan().nodes if node is None or n.node_rank == node]
    files = [(n.label, record.node_log(n.node_rank)) for n in nodes]

    def relabel() -> dict[Path, str]:  # after a host was replaced, the plan names the spare
        return {record.node_log(n.node_rank): n.label for n in record.plan().nodes}

    return tail(files, lambda: follow and not scheduler.state(record).state.is_terminal, relabel)


def wait_terminal(
    scheduler: HasState, record: JobRecord, timeout_s: float, poll_s: float
) -> JobStatus | None:
    """The job's status once it is terminal, or None if it is not within ``timeout_s`` seconds (asked
    every ``poll_s`` seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = scheduler.state(record)
        if status.state.is_terminal:
            return status
        time.sleep(poll_s)
    return None
