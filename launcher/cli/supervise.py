"""``launcher supervise --job-dir DIR``: a job's controller in the foreground. It runs the job of a
job record (its Plan, through its scheduler's Transport, found through the registry) attempt after
attempt to its end, records the end, and exits with the job's exit code. ``launcher submit`` starts
exactly this for local, SSH and compose jobs (``launcher.supervisor.supervisor.start_supervisor``);
it is not in ``launcher --help``: a user has no need to call it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from gptlaunch.contract import EXIT_FAILED, EXIT_USAGE
from launcher.job.plan import Plan
from launcher.job.record import JobRecord, JobState, Outcome
from launcher.schedulers import get_scheduler
from launcher.supervisor.scheduler import SupervisedScheduler
from launcher.supervisor.supervisor import supervise
from launcher.supervisor.transport import Transport


def main(argv: list[str] | None = None) -> int:
    """Exits with the job's exit code once the job ended (returns only on a usage error: 2)."""
    p = argparse.ArgumentParser(
        prog="launcher supervise",
        description="Run a job's attempts in the foreground to its end (what `launcher submit` starts "
        "for local, SSH and compose jobs); exit with the job's exit code.",
    )
    p.add_argument("--job-dir", type=Path, required=True, help="the job record (jobs/<job id>)")
    p.add_argument("--ready-fd", type=int, default=-1, help=argparse.SUPPRESS)  # closed once started
    args = p.parse_args(argv)
    if not (args.job_dir / "plan.json").is_file():
        return _usage(f"{args.job_dir} is not a job record (no plan.json)")
    record = JobRecord(args.job_dir.absolute())
    plan = record.plan()
    scheduler = get_scheduler(plan.scheduler)
    # A scheduler whose jobs this command runs gives it its Transport.
    transport_of: Callable[[Plan, JobRecord], Transport] | None = getattr(scheduler, "transport", None)
    if transport_of is None:
        return _usage(f"{plan.scheduler} jobs are not run by this command")
    try:
        transport = transport_of(plan, record)
    except Exception as e:  # the job must still end in its record, saying why
        record.finish(Outcome(state=JobState.FAILED, exit_code=EXIT_FAILED, message=f"launcher error: {e!r}"))
        raise
    # A scheduler with a queue has its own handle on the job (SLURM's job id): not this process.
    own = isinstance(scheduler, SupervisedScheduler)
    code = supervise(record, transport, ready_fd=args.ready_fd, handle=own)
    # The end is recorded and nothing of the job runs: exit now. An interpreter's teardown would keep
    # this process (whose command line names the job) alive after its callers saw the job end.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _usage(error: str) -> int:
    print(f"launcher supervise: error: {error}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
