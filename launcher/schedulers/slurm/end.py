"""The standalone sbatch script's last step (``python -m launcher.schedulers.slurm.end``), run on the
batch node when the nodes' step failed: the step's exit code and the ranks' stop marker (in the run
dir, or its copy in the job record: ``launcher.job.failures.stop_marker``) and the nodes' hang reports
(``launcher.job.reports``) become the job's exit code and one line in the batch log. After a
checkpoint on SLURM's warning signal (SIGUSR2), with requeues left, it exits 0: the script then
requeues the job (``scontrol`` on the batch node, as this step may run in the job's image), which
resumes from that checkpoint.

The submitit path ends the same way through submitit (its requeue on the warning signal) and
``launcher submit``'s reading of the job (``launcher.schedulers.slurm.state``). The standalone script
keeps no job record, so it does not retry after a failure (``--retries``): ``launcher submit`` does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gptlaunch.contract import EXIT_CHECKPOINTED
from launcher.job import reports
from launcher.job.failures import stop_marker
from launcher.job.hang import EXIT_HANG, merge
from launcher.job.verdict import Ending, Facts, verdict

REQUEUE = 0  # this step's exit code that asks the script to requeue the job


def ending(
    *, exit_code: int, run_dir: Path, job_dir: Path, since: float, restarts: int, max_requeues: int
) -> tuple[int, str]:
    """(this step's exit code: ``REQUEUE`` or the job's, what to say) after the nodes' step failed
    with ``exit_code``; the run started at ``since`` (epoch seconds), after ``restarts`` requeues.
    How it ended is ``launcher.job.verdict``'s, from the stop marker and the nodes' hang reports."""
    hangs = reports.hangs(job_dir, since=since)
    facts = Facts(
        plan=None,
        job_dir=job_dir,
        agents=(exit_code,),
        first_failed=0,
        marker=stop_marker(run_dir, since, job_dir),
        hang=merge(hangs) if hangs else None,
    )
    end = verdict(facts)
    if end.ending == Ending.STOPPED and facts.marker is not None:
        if facts.marker.signal == "SIGUSR2" and restarts < max_requeues:
            return REQUEUE, f"checkpoint saved; requeueing (restart {restarts + 1} of at most {max_requeues})"
        return (
            EXIT_CHECKPOINTED,
            f"stopped after the checkpoint of step {facts.marker.step}; submit again to resume",
        )
    # srun's exit code prefers a task killed by a signal to any task's exit code: a node task that
    # srun's kill-on-bad-exit SIGTERM caught while its Python was exiting (the default handler back)
    # makes it 15, not the hang's 124. The nodes' hang reports in the job record say what happened.
    if end.ending == Ending.HUNG or exit_code == EXIT_HANG:
        said = (
            f"the ranks hung (no progress): the cause is in {job_dir}/node-*.log, stacks in {job_dir}/hang/"
        )
        return EXIT_HANG, said
    return exit_code, f"a node failed (srun exit {exit_code}); see {job_dir}/node-*.log"


def main(args: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launcher.schedulers.slurm.end",
        description="End a standalone sbatch script's job after its nodes' step failed.",
    )
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--job-dir", type=Path, required=True)
    p.add_argument("--max-requeues", type=int, required=True)
    p.add_argument("--since", type=float, required=True, help="when this run started (epoch seconds)")
    p.add_argument("--exit-code", type=int, required=True, help="the nodes' step's (srun's), not 0")
    a = p.parse_args(args)
    if a.exit_code == 0:
        p.error("--exit-code 0: the step succeeded, there is nothing to end")
    code, said = ending(
        exit_code=a.exit_code, run_dir=a.run_dir, job_dir=a.job_dir, since=a.since,
        restarts=int(os.environ.get("SLURM_RESTART_COUNT") or 0), max_requeues=a.max_requeues,
    )  # fmt: skip
    print(f"batch: {said}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
