"""The SLURM scheduler: one allocation of ``nnodes`` nodes (and ``--spare-nodes``), run by the job's
controller on its first node (``launcher.schedulers.slurm.controller``), submitted through submitit or
as the standalone sbatch script (``launcher.schedulers.slurm.script``); a sweep is one job array. How
a job runs and ends, and which states come from ``sacct``: docs/schedulers/slurm.md; the array:
docs/sweeps.md.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import submitit
from pydantic import BaseModel, ConfigDict

from launcher.image.reference import resolve as resolve_image
from launcher.job.console import say
from launcher.job.logs import wait_terminal
from launcher.job.plan import Plan, build_plan, workdir_of
from launcher.job.record import JobError, JobRecord, JobState, JobStatus
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import agent_env, worker_argv
from launcher.schedulers.slurm import steps
from launcher.schedulers.slurm.controller import Controller, node_commands, record_json
from launcher.schedulers.slurm.image import SlurmFacts, job_image, pick_runtime
from launcher.schedulers.slurm.options import SlurmOptions, time_note
from launcher.schedulers.slurm.run_copy import mark_run_dir
from launcher.schedulers.slurm.script import FIRST_HOST_LINE, sbatch_options, sbatch_script
from launcher.schedulers.slurm.state import Accounting, SlurmHandle, end_outcome, job_state, lost_controller
from launcher.schedulers.slurm.transport import SrunAgents, allocation_hosts, placed
from launcher.supervisor.scheduler import RecordFollowed

SCRIPT = "job.sbatch"
# What submitit is given (its parameters and the batch script's setup lines), rendered with the script:
# `submit` runs exactly this, computing nothing of its own.
SUBMITIT_REQUEST = "submitit.json"
# What submit hands to sbatch through submitit: its submission file, as submitit writes it
# (``launcher render --file submitit.sbatch``).
SUBMITIT_SCRIPT = "submitit.sbatch"
CHECKS = "checks.sh"  # in a job record of a sweep's array: its run's checks before training
ARRAY_DIRS = "array-dirs.txt"  # beside the array's submitit folder: the runs' job records, by task
POLL_S = 0.5  # between state reads while waiting (each reads sacct at most every 2 s)
# Beyond the grace period, for a stop through the controller: its read of the record (every second),
# the agents' signal steps, and the end recorded.
STOP_MARGIN_S = 15.0
SCANCEL_WAIT_S = 120.0  # SLURM's KillWait (30 s by default) plus the time to clean up a node
NO_SLURM = "is not on PATH: run on a SLURM login node (to try it here: deploy/slurm/dev-cluster.sh up)"
# The batch shell gets SIGUSR2 too from `scancel --signal=USR2 --full`: it must outlive it.
BATCH_SETUP = [
    "trap 'echo \"batch: SIGUSR2: the ranks checkpoint; the job is requeued\"' USR2",
    FIRST_HOST_LINE,
]


class SubmitRejected(SpecError):
    """SLURM refused the job (bad partition, too many nodes, ...); the message is SLURM's own."""


class SubmititRequest(BaseModel):
    """What ``submit`` hands to submitit's ``update_parameters``: its own parameters, the other sbatch
    options and the batch script's setup lines."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    parameters: dict[str, str | int | bool | list[str]]
    additional_parameters: dict[str, str | bool]
    setup: list[str]
    python: str  # the controller's interpreter


def _submitit_request(spec: JobSpec, options: dict[str, str], checks: list[str]) -> SubmititRequest:
    """What submitit is given: the allocation, the checks before training as setup lines, and the
    controller's interpreter (the host's, which has srun: not in the image)."""
    opts = spec.options(SlurmOptions)
    named = ("job-name", "nodes", "ntasks-per-node", "time", "signal")  # submitit's own parameters
    parameters: dict[str, str | int | bool | list[str]] = {
        "job_name": options["job-name"],
        "nodes": spec.nnodes + opts.spare_nodes,
        "ntasks_per_node": 1,
        "time": int(options["time"]),
        "signal_delay_s": opts.signal_delay_s,
        "use_srun": False,  # the controller in the batch step, one task: it starts the nodes' steps
    }
    # Requeueable (a cluster's JobRequeue=0 would make a preemption the end), and the submitting
    # environment exported: the secrets reach the job from there.
    extra = {k: v or True for k, v in options.items() if k not in named}
    extra |= {"requeue": True, "export": "ALL"}
    return SubmititRequest(
        parameters=parameters,
        additional_parameters=extra,
        setup=[*BATCH_SETUP, *checks],  # parity and the health gate
        python=shlex.quote(spec.python),
    )


def _executor(request: SubmititRequest, folder: Path, max_requeues: int) -> submitit.SlurmExecutor:
    """submitit's executor of the job, its files in ``folder`` (``job_dir/submitit``)."""
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=max_requeues, python=request.python)
    executor.update_parameters(
        **request.parameters,
        additional_parameters=request.additional_parameters,
        setup=request.setup,
    )
    return executor


def _submitit_script(request: SubmititRequest, job_dir: Path, max_requeues: int) -> str:
    """The submission file that submitit's ``submit`` hands to sbatch for this job, written by submitit
    itself. Its public API has no renderer (``PicklingExecutor._submit_command`` writes the file and
    runs sbatch in one method), so its ``submit`` runs here against a stand-in sbatch, in a scratch
    folder; each value that starts with the scratch folder (an ``#SBATCH`` path, the command's
    argument) is then the job's ``job_dir/submitit``, quoted as submitit quotes them (``shlex``)."""
    with tempfile.TemporaryDirectory(prefix="launcher-render-") as scratch:
        stand_ins = Path(scratch, "bin")
        stand_ins.mkdir()
        for name in ("sbatch", "srun"):  # the executor looks for srun; sbatch only acknowledges
            (stand_ins / name).write_text("#!/bin/sh\necho 'Submitted batch job 1'\n")
            (stand_ins / name).chmod(0o755)
        folder, path = str(Path(scratch, "submitit")), os.environ.get("PATH", os.defpath)
        os.environ["PATH"] = f"{stand_ins}{os.pathsep}{path}"
        try:
            job = _executor(request, Path(folder), max_requeues).submit(Controller(str(job_dir)))
            text = job.paths.submission_file.read_text()
        finally:
            os.environ["PATH"] = path
    real = str(job_dir / "submitit")
    return re.sub(re.escape(folder) + r"\S*", lambda m: shlex.quote(real + m[0][len(folder) :]), text)


def gpus_asked(spec: JobSpec, opts: SlurmOptions) -> bool:
    """Whether the job requests GPUs: as ``--slurm-gpus`` says, else when the partition's nodes have
    GPU GRES (``sinfo``'s ``%G``, one per line: ``gpu:8``, ``(null)``), or sinfo cannot tell (the GPU
    clusters this is for). Never silently none: a job that requests none for that reason says so,
    naming the GRES and the flag."""
    if opts.gpus is not None:
        return opts.gpus
    partition = [f"--partition={opts.partition}"] if opts.partition else []
    argv = ["sinfo", "--noheader", "--format=%G", *partition]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return True
    gres = " ".join(sorted(set(out.split())))
    if "gpu" in gres:
        return True
    where = f"partition {opts.partition}" if opts.partition else "the default partition"
    say(
        f"launcher: note: the nodes of {where} have no GPU in their GRES (sinfo: {gres or 'none'}): no "
        f"GPUs are requested, and each node runs {spec.nproc_per_node} CPU process(es); --slurm-gpus "
        "requests them"
    )
    return False


class SlurmScheduler(RecordFollowed):
    name = "slurm"
    files_here = False  # the nodes see the job record and run dir (shared), not necessarily the data
    queued = True  # submit returns once SLURM accepted the job; --wait follows it

    def __init__(self) -> None:
        self._accounting = Accounting()

    def preflight(self, spec: JobSpec, plan: Plan, job_dir: Path) -> Plan:
        """Nothing to try before a job here: the health gate (``--health-check``) runs in the allocation,
        before training (``launcher.schedulers.slurm.steps.gate_lines``)."""
        return plan

    def resolve(self, spec: JobSpec) -> SlurmFacts:
        """The working directory (absolute) and whether to request GPUs (asked from sinfo when not set:
        where sinfo is missing, GPUs are requested, as on the GPU clusters this is for)."""
        opts = spec.options(SlurmOptions)
        if (note := time_note(opts.time)) is not None:
            say(f"launcher: note: {note}")
        gpus = gpus_asked(spec, opts)
        image = runtime = None
        if opts.image is not None:
            image, runtime = resolve_image(opts.image), pick_runtime(opts.container_runtime)
            say(f"launcher: image {opts.image} is {image} ({runtime} on every node)")
        return SlurmFacts(
            workdir=workdir_of(spec, files_here=self.files_here),
            gpus_per_node=spec.nproc_per_node if gpus else 0,
            image=image,
            runtime=runtime,
        )

    def render(self, spec: JobSpec, facts: SlurmFacts, job_id: str, job_dir: Path) -> Plan:
        opts = spec.options(SlurmOptions)
        host, port = steps.rendezvous(spec)
        endpoint = f"{host}:{port}"
        worker, run_dir = worker_argv(spec, job_dir / "run")
        image = job_image(spec, facts, job_dir, run_dir)
        threads = spec.omp_num_threads or (
            max(1, opts.cpus_per_task // spec.nproc_per_node) if opts.cpus_per_task else None
        )
        env = agent_env(spec, job_id, threads, run_dir)
        nodes = node_commands(spec, job_id, job_dir, facts.workdir, (worker, run_dir), env, image, endpoint)
        plan = build_plan(self.name, spec, facts, job_id, endpoint=endpoint, run_dir=run_dir, nodes=nodes)
        options = sbatch_options(spec, opts, job_id, facts.gpus_per_node)

        # The steps before training: parity of every node allocated, then the health gate, a node it
        # names the controller's first failed attempt with --retries.
        parity = steps.parity_lines(spec, facts, job_dir, image, plan.nnodes + opts.spare_nodes)
        gate = steps.gate_lines(spec, facts.workdir, job_dir, env, image, carry_on=spec.retries > 0)
        checked = [*parity, *([""] if gate else []), *gate]
        # The standalone script: the job record it writes on its first run, the checks, the controller.
        script = sbatch_script(
            spec,
            job_id=plan.job_id,
            options=options,
            job_dir=str(job_dir),
            workdir=facts.workdir,
            checks=checked,
            record=record_json(spec, plan),
            image=image.header() if image else None,
        )
        request = _submitit_request(spec, options, checked)
        files = {
            SCRIPT: script,
            SUBMITIT_REQUEST: request.model_dump_json(indent=2) + "\n",
            SUBMITIT_SCRIPT: _submitit_script(request, job_dir, opts.max_requeues),
        }
        return plan.model_copy(update={"files": files, "primary": SCRIPT})

    def submit(self, plan: Plan, record: JobRecord, *, detach: bool) -> SlurmHandle:
        """Submit through submitit; return once SLURM accepted the job (``detach`` is moot: the job
        lives in SLURM's queue). Raises SubmitRejected with SLURM's error when sbatch refuses it."""
        _check_slurm_here()
        opts = record.spec().options(SlurmOptions)
        request = SubmititRequest.model_validate_json(plan.files[SUBMITIT_REQUEST])
        executor = _executor(request, record.dir / "submitit", opts.max_requeues)
        mark_run_dir(plan, opts.node_local_run_dir)  # the nodes that do not see it copy the run dir
        # submitit echoes sbatch's error, which _sbatch reports
        with _sbatch("the job"), contextlib.redirect_stderr(io.StringIO()):
            job = executor.submit(Controller(str(record.dir)))
        return _pending(record, str(job.job_id), executor.folder)

    def submit_array(
        self, runs: list[tuple[Plan, JobRecord]], folder: Path, max_parallel: int | None
    ) -> list[SlurmHandle]:
        """A sweep's ``runs`` (each a Plan and its job record) as one job array, submitit's files in
        ``folder``, at most ``max_parallel`` tasks at once; each task is one run's whole job. One batch
        script serves them all, so each run's checks before training go into ``CHECKS`` in its job
        record, which the script sources for its task (``ARRAY_DIRS``). Returns each run's handle
        (its task's id), also written in its record. Raises SubmitRejected with SLURM's error when
        sbatch refuses it."""
        _check_slurm_here()
        requests = [SubmititRequest.model_validate_json(plan.files[SUBMITIT_REQUEST]) for plan, _ in runs]
        executor = _executor(requests[0], folder, runs[0][1].spec().options(SlurmOptions).max_requeues)
        dirs = executor.folder.parent / ARRAY_DIRS
        with _sbatch("the sweep's array"):
            dirs.write_text("".join(f"{record.dir}\n" for _, record in runs))
            for (plan, record), request in zip(runs, requests, strict=True):
                (record.dir / CHECKS).write_text("\n".join(request.setup[len(BATCH_SETUP) :]) + "\n")
                mark_run_dir(plan, record.spec().options(SlurmOptions).node_local_run_dir)
            task_dir = f'"$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {shlex.quote(str(dirs))})"'
            executor.update_parameters(
                job_name=runs[0][1].dir.parent.name,  # the sweep's id: squeue and sacct show the array by it
                setup=[*BATCH_SETUP, f"source {task_dir}/{CHECKS}"],
                array_parallelism=max_parallel or len(runs),
            )
            with contextlib.redirect_stderr(io.StringIO()), executor.batch():  # as in ``submit``
                jobs = [executor.submit(Controller(str(record.dir))) for _, record in runs]
            task = " (a task of the sweep's array)"
            pairs = zip(jobs, runs, strict=True)
            return [_pending(record, str(job.job_id), executor.folder, task) for job, (_, record) in pairs]

    def state(self, record: JobRecord) -> JobStatus:
        """The recorded status, brought up to date from SLURM's accounting (at most every few seconds
        per process); the end, once SLURM reports it, is recorded with its cause."""
        status = record.status()
        handle = record.handle(SlurmHandle)
        if status.state.is_terminal or handle is None:
            return status
        info = self._accounting.info(handle.slurm_job_id)
        if info is None:  # not in accounting yet: still where submit left it
            return status
        state = job_state(info.state)
        if state is None:
            return status
        if state.is_terminal:
            status = record.status()  # the controller records the end itself, maybe just now
            if status.state.is_terminal:
                return status
            lost = status.state == JobState.RUNNING  # the controller ran, and never recorded the end
            return record.finish(lost_controller(info, record) if lost else end_outcome(info, record))
        if status.state == JobState.RUNNING:  # the controller's: it says the rest
            return status
        message = f"SLURM job {handle.slurm_job_id}: {info.state}"
        if state == JobState.RUNNING:  # pending until the controller starts the nodes
            state, message = JobState.PENDING, f"{message} (the checks before training)"
        if state == JobState.PENDING and info.reason:
            message += f" ({info.reason})"
        if state == JobState.PENDING and status.started_at is not None:
            message += " (requeued: it resumes from its last checkpoint)"
        changes = {
            "state": state,
            "message": message,
            "started_at": info.start if state == JobState.RUNNING else status.started_at,
        }
        if all(getattr(status, k) == v for k, v in changes.items()):
            return status
        # not if the controller recorded its start (or more) since this read
        return record.update_status(if_state=status.state, **changes)

    def transport(self, plan: Plan, record: JobRecord) -> SrunAgents:
        """The controller's, in the job's allocation: its nodes on the allocation's first hosts (the
        rest are spares), recorded in the job's Plan."""
        hosts = allocation_hosts()
        here = placed(plan, hosts[: plan.nnodes])
        record.write_plan(here)
        image = job_image(record.spec(), plan.facts_as(SlurmFacts), record.dir, plan.run_dir)
        return SrunAgents(here, record, hosts, since=time.time(), image=image)

    def cancel(self, record: JobRecord, *, wait: bool = True) -> JobStatus:
        """A running job's controller is asked to stop, through the job record (it runs in the
        allocation): its ranks checkpoint and exit, and it records the end. A job still queued or
        checking its nodes, or still running after the grace period (or asked a second time), is
        cancelled by SLURM (``scancel``: SIGTERM, then SIGKILL after KillWait)."""
        status = self.state(record)
        handle = record.handle(SlurmHandle)
        if status.state.is_terminal or handle is None:
            return status
        if shutil.which("scancel") is None:
            raise JobError(f"scancel {NO_SLURM}")
        if status.state == JobState.RUNNING and status.stop_requested_at is None:
            record.update_status(stop_requested_at=time.time())  # the controller reads it there
            if not wait:
                return self.state(record)
            final = wait_terminal(self.state, record, record.spec().grace_period_s + STOP_MARGIN_S, POLL_S)
            if final is not None:
                return final
        # Queued, asked a second time, or still running after the grace period: SLURM cancels it.
        _scancel(handle.slurm_job_id)
        if not wait:
            return self.state(record)
        final = wait_terminal(self.state, record, SCANCEL_WAIT_S, POLL_S)
        if final is None:
            raise JobError(f"SLURM job {handle.slurm_job_id} did not end within {SCANCEL_WAIT_S:.0f} s")
        return final


@contextlib.contextmanager
def _sbatch(what: str) -> Iterator[None]:
    """Submitting ``what`` ("the job", for the message): sbatch's refusal, or another failure to submit,
    raised as SubmitRejected."""
    try:
        yield
    except submitit.core.utils.FailedJobError as e:
        raise SubmitRejected(f"SLURM refused {what}: {str(e).strip() or 'sbatch failed'}") from None
    except (RuntimeError, OSError) as e:  # no srun here, sbatch output not understood, ...
        raise SubmitRejected(f"submitting to SLURM failed: {e}") from None


def _pending(record: JobRecord, slurm_job_id: str, folder: Path, what: str = "") -> SlurmHandle:
    """``record``'s handle on SLURM job ``slurm_job_id``, written, and its status pending: not over
    what its controller, started meanwhile, recorded."""
    handle = SlurmHandle(slurm_job_id=slurm_job_id, submitit_folder=str(folder))
    record.write_handle(handle)
    message = f"SLURM job {slurm_job_id}{what}"
    record.update_status(if_state=JobState.CREATED, state=JobState.PENDING, message=message)
    return handle


def _check_slurm_here() -> None:
    """Raises SubmitRejected when SLURM's commands that submit are not on PATH."""
    for command in ("sbatch", "srun"):
        if shutil.which(command) is None:
            raise SubmitRejected(f"{command} {NO_SLURM}")


def _scancel(slurm_job_id: str) -> None:
    """scancel; a job that is already ending (or gone from the controller) is not an error."""
    try:
        subprocess.run(["scancel", slurm_job_id], capture_output=True, text=True, check=True, timeout=60)
    except subprocess.CalledProcessError as e:
        if not re.search(r"already completing|completed|invalid job id", e.stderr, re.IGNORECASE):
            raise JobError(f"scancel {slurm_job_id} failed: {e.stderr.strip() or e}") from None
    except subprocess.TimeoutExpired:
        raise JobError(f"scancel {slurm_job_id} did not answer in 60 s: is slurmctld up?") from None
