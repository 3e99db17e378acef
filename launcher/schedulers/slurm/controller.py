"""What runs a SLURM job in its allocation: ``Controller``, which submitit runs once per allocation in
the batch step and which execs ``launcher supervise`` (every scheduler's controller), each node's
agent command, and the standalone script's job record. How the controller works there:
docs/contributors/architecture.md, "SLURM: the controller inside the allocation".

Not submitit's ``checkpoint()`` for requeues: its handler of SLURM's signal requeues the job as soon as
``checkpoint()`` returns, from inside the handler (``submitit/core/job_environment.py``,
``SignalHandler.checkpoint_and_try_requeue``), while the controller must first follow every rank to
its checkpoint; and SLURM's warning before the time limit (``--signal=USR2@T``, as submitit renders
it in ``submitit/slurm/slurm.py`` ``_make_sbatch_string``) is sent to the job's steps, not to the batch
step that submitit's callable runs in. The ranks get it, checkpoint and stop; the controller sees
that and requeues the job (``SrunAgents.requeue``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gptlaunch.contract import EXIT_FAILED, FIRST_HOST_ENV
from launcher.agent.transport import agent_argv
from launcher.image.runtime import ImageRun
from launcher.job.hang import heartbeat_dir
from launcher.job.plan import NodeCommand, Plan
from launcher.job.record import JobRecord, JobState, JobStatus, agent_dir
from launcher.job.spec import JobSpec
from launcher.job.torchrun import IMAGE_PYTHON, copy_excludes, node_agents
from launcher.schedulers.slurm.image import SlurmImage
from launcher.schedulers.slurm.options import SlurmOptions
from launcher.schedulers.slurm.run_copy import wrapper_argv
from launcher.schedulers.slurm.state import SlurmHandle
from launcher.supervisor.supervisor import SUPERVISE

ALLOCATED = "(allocated by SLURM)"  # a node's host until the controller places it
# What a podman container passes on to the node's command, beside the Plan's variables: the
# rendezvous host the controller sets, SLURM's job id (the rendezvous port) and the GPUs it gave.
IN_CONTAINER = (FIRST_HOST_ENV, "SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Controller:
    """What submitit runs once per allocation: ``launcher supervise --job-dir job_dir`` in its place."""

    job_dir: str

    def __call__(self) -> None:
        argv = [sys.executable, *SUPERVISE, "--job-dir", self.job_dir]
        os.execv(argv[0], argv)  # submitit's signal handlers go with its process


def node_commands(
    spec: JobSpec, job_id: str, job_dir: Path, workdir: str, run: tuple[list[str], str],
    env: dict[str, str], image: SlurmImage | None, endpoint: str,
) -> list[NodeCommand]:  # fmt: skip
    """Each node's agent (``launcher.agent run``) running its torchrun, whose rank is known now (a
    static rendezvous at node 0) and whose rendezvous host and port are filled in on the node
    (``launcher.job.node``: ``{{first_host}}``, set by the controller, and ``{{rdzv_port}}``), behind
    the run dir's copy (``launcher.schedulers.slurm.run_copy``) unless the run dir is declared shared.
    ``run``: what each rank runs and the run dir (in ``workdir``); ``endpoint``: the rendezvous
    (``steps.rendezvous``). With an image, torchrun runs in it; so does the agent, but with podman (it
    starts the container)."""
    worker, run_dir = run
    python = IMAGE_PYTHON if image else spec.python
    runs = node_agents(spec, endpoint=endpoint, job_id=job_id, job_dir=job_dir, worker=worker, python=python)
    podman = None  # with podman, the node task runs torchrun in a container, passing these variables in
    if image is not None and image.runtime == "podman":
        names = (*env, *spec.secret_env, *IN_CONTAINER)
        podman = ImageRun(image.image, "podman", image.mounts, names, image.workdir)
    entry = [python, "-m", "launcher.job.node", "--workdir", workdir, "--"]
    run_dir = str(Path(workdir) / run_dir)
    declared = spec.options(SlurmOptions).node_local_run_dir
    excluded = copy_excludes(spec, workdir, run_dir)
    argv = []
    for k, torchrun in enumerate(runs):
        copied = wrapper_argv(python, job_dir, run_dir, k, job_id, declared, excluded, spec.allow_start_over)
        agent = agent_argv(
            image.python if image else spec.python, spec, job_id, k, [*entry, *copied, *torchrun],
            heartbeat_dir=heartbeat_dir(job_dir, k), state_dir=agent_dir(job_dir),
            image_flags=podman.flags() if podman else [],
        )  # fmt: skip
        argv.append(image.wrap(agent) if image else agent)
    return [NodeCommand(host=ALLOCATED, argv=a, env=env) for a in argv]


def write_record(job_dir: Path, text: str) -> None:
    """The standalone script's job record in ``job_dir``, from ``text`` (``record_json``), written by
    the job's first run; a requeued run finds it and writes nothing. Raises OSError."""
    if (job_dir / "plan.json").is_file():
        return
    record = json.loads(text)
    spec, plan = JobSpec.model_validate(record["spec"]), Plan.model_validate(record["plan"])
    slurm_job_id = os.environ.get("SLURM_JOB_ID", "")
    status = JobStatus(state=JobState.PENDING, created_at=time.time(), message=f"SLURM job {slurm_job_id}")
    JobRecord.create(job_dir, spec, plan, status).write_handle(
        SlurmHandle(slurm_job_id=slurm_job_id, submitit_folder="")
    )


def record_json(spec: JobSpec, plan: Plan) -> str:
    """The job record of the standalone script (its spec and Plan, without the Plan's files: the
    script is one of them), one JSON line for ``write_record``."""
    bare = plan.model_copy(update={"files": {}, "primary": None})
    return json.dumps({"spec": spec.model_dump(mode="json"), "plan": bare.model_dump(mode="json")})


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.schedulers.slurm.controller --job-dir DIR < RECORD``: ``write_record``."""
    p = argparse.ArgumentParser(prog="python -m launcher.schedulers.slurm.controller")
    p.add_argument("--job-dir", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        write_record(args.job_dir, sys.stdin.read())
    except (OSError, ValueError) as e:
        print(f"batch: cannot write the job record in {args.job_dir}: {e}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
