"""An attempt's facts (``launcher.job.verdict.Facts``) read from the job record: the ranks' stop
marker, the nodes' refusals, hang reports and ends, the ranks' error files. The one reader of them
for every controller; what only the controller knows (the agents' exit codes, a stop request, what
the scheduler says) it passes in.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from launcher.job import reports
from launcher.job.failures import global_ranks, read_errors, stop_marker, worker_deaths
from launcher.job.hang import merge, write_stacks
from launcher.job.plan import Plan
from launcher.job.record import JobRecord
from launcher.job.verdict import Facts


def gather(record: JobRecord, since: float, plan: Plan | None = None) -> Facts:
    """What the job record holds of the attempt that started at ``since`` (epoch seconds) on ``plan``
    (default: the record's); the controller adds what it knows with ``dataclasses.replace``. The
    nodes' hang reports are merged and every rank's stack written to ``JOB/hang/``
    (``launcher.job.hang.write_stacks``)."""
    plan = plan or record.plan()
    hang = None
    if hangs := reports.hangs(record.dir, since=since):
        hang = merge(hangs, {n.node_rank: n.named_host for n in plan.nodes if n.named_host})
        with contextlib.suppress(OSError):  # a reader's read-only copy: the stacks stay in the reports
            write_stacks(record.dir, hang)
    refused = reports.read(record.dir, reports.Refused, since)
    errors = read_errors(record, plan.nnodes, since)
    return Facts(
        plan=plan,
        job_dir=record.dir,
        marker=stop_marker(Path(plan.run_dir), since, record.dir),
        refused=refused[-1] if refused else None,
        hang=hang,
        errors=tuple(errors),
        deaths=tuple(worker_deaths(record, plan.nnodes)),
        ranks=global_ranks(record, errors),
    )
