"""A sweep on SLURM: one job array (``sbatch --array=0-N%K``, through submitit's ``batch()``), each of
its tasks one run's whole job: its own allocation, its checks before training and its controller
(``Controller``, as a single job's), its own job record.

One array has one batch script, so what differs between runs cannot be in it: each run's checks
before training (parity, the health gate: ``SubmititRequest.setup``, which name the run's job record)
go into ``checks.sh`` in its job record, and the array's script sources the one of its task
(``ARRAY_DIRS``: the runs' job records, one per line, in task order). Each run's record holds its own
task's id (``ARRAYID_TASK``), which sacct, scancel and a requeue take as any job id.
"""

from __future__ import annotations

import contextlib
import io
import shlex
from pathlib import Path

import submitit

from launcher.job.plan import Plan
from launcher.job.record import JobRecord, JobState
from launcher.schedulers.slurm.controller import Controller
from launcher.schedulers.slurm.options import SlurmOptions
from launcher.schedulers.slurm.run_copy import mark_run_dir
from launcher.schedulers.slurm.state import SlurmHandle

CHECKS = "checks.sh"  # in a run's job record: its checks before training
ARRAY_DIRS = "array-dirs.txt"  # beside the submitit folder: the runs' job records, by task


def task_setup(batch_setup: list[str], dirs: Path) -> list[str]:
    """The array's setup lines: the batch setup every job has, then its task's checks."""
    task_dir = f'"$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {shlex.quote(str(dirs))})"'
    return [*batch_setup, f"source {task_dir}/{CHECKS}"]


def submit_array(
    runs: list[tuple[Plan, JobRecord]],
    executor: submitit.SlurmExecutor,
    batch_setup: list[str],
    setups: list[list[str]],
    max_parallel: int | None,
) -> list[SlurmHandle]:
    """Submit ``runs`` (each a Plan and its job record, whose checks are ``setups``) as one job array
    through ``executor`` (set up from the first run's request), at most ``max_parallel`` tasks at once.
    Returns each run's handle, also written in its record. Raises submitit's FailedJobError when sbatch
    refuses the array."""
    dirs = executor.folder.parent / ARRAY_DIRS
    dirs.write_text("".join(f"{record.dir}\n" for _, record in runs))
    for (plan, record), setup in zip(runs, setups, strict=True):
        (record.dir / CHECKS).write_text("\n".join(setup[len(batch_setup) :]) + "\n")
        mark_run_dir(plan, record.spec().options(SlurmOptions).node_local_run_dir)
    executor.update_parameters(
        job_name=runs[0][1].dir.parent.name,  # the sweep's id: squeue and sacct show the array by it
        setup=task_setup(batch_setup, dirs),
        array_parallelism=max_parallel or len(runs),
    )
    with (
        contextlib.redirect_stderr(io.StringIO()),
        executor.batch(),
    ):  # sbatch's error: reported by the caller
        jobs = [executor.submit(Controller(str(record.dir))) for _, record in runs]
    handles = []
    for job, (_, record) in zip(jobs, runs, strict=True):
        handle = SlurmHandle(slurm_job_id=str(job.job_id), submitit_folder=str(executor.folder))
        record.write_handle(handle)
        record.update_status(  # not over what its controller, started meanwhile, recorded
            if_state=JobState.CREATED,
            state=JobState.PENDING,
            message=f"SLURM job {job.job_id} (a task of the sweep's array)",
        )
        handles.append(handle)
    return handles
