"""The health gate of a SLURM job (``--health-check``, ``--health-check-warn``): a step of the batch script
after version parity, in the allocation, before any rank of the job starts
(``launcher.preflight.health_step``). Each node runs the collective preflight with the gate's stages
under torchrun, with the job's environment, ranks per node and precision, meeting at the job's
rendezvous host and port (free until the job's own rendezvous); in the job's image when it has one.
"""

from __future__ import annotations

from pathlib import Path

from launcher.job.reports import REPORT_DIR_ENV
from launcher.job.spec import JobSpec
from launcher.job.torchrun import IMAGE_PYTHON
from launcher.preflight.health import GATE_TIMEOUT_S, GateSettings, worker_argv
from launcher.preflight.health_step import HEALTH_DIR, batch_lines, judge_argv
from launcher.preflight.parity_step import PULL_TIME_MIN, STEP_TIME_MIN
from launcher.schedulers.slurm.image import SlurmImage
from launcher.schedulers.slurm.options import SlurmOptions


def gate_lines(
    spec: JobSpec,
    workdir: str,
    job_dir: Path,
    env: dict[str, str],
    image: SlurmImage | None,
    retry: str | None = None,
) -> list[str]:
    """The batch script's lines of the gate (none without ``--health-check``/``--health-check-warn``).
    ``env`` is the nodes' environment (the Plan's), ``retry`` the retry step run when the gate ends
    the job (``--retries``; None in the standalone script, which does not retry)."""
    opts = spec.options(SlurmOptions)
    if not opts.gate:
        return []
    gate = GateSettings.of_job(spec.trainer_args, opts.min_busbw, spec.nproc_per_node)
    rdzv = spec.rendezvous
    master = (rdzv.endpoint or "{{first_host}}", rdzv.port or "{{rdzv_port}}")
    torchrun = [
        *worker_argv(spec.nnodes, spec.nproc_per_node, "{{node_rank}}", master, GATE_TIMEOUT_S),
        *gate.worker_args(),
    ]
    # The environment is set before the node entry, which fills in placeholders in its argv only, as
    # the job's own environment is never filled in. The workers report into the gate's directory.
    env = env | {REPORT_DIR_ENV: str(job_dir / HEALTH_DIR)}
    assignments = ["env", *(f"{k}={v}" for k, v in sorted(env.items()))]
    entry = ["-m", "launcher.job.node", "--workdir", workdir, "--"]
    if image is None:
        node = [*assignments, spec.python, *entry, spec.python, *torchrun]
    elif image.runtime == "podman":  # the entry on the host, the workers in a container
        workers = image.run([IMAGE_PYTHON, *torchrun], env_names=sorted(env))
        node = [*assignments, image.host_python, *entry, *workers]
    else:  # pyxis (srun's options) and apptainer (a prefix): the whole task in the image
        node = image.wrap([*assignments, IMAGE_PYTHON, *entry, IMAGE_PYTHON, *torchrun])
    judge = judge_argv(
        image.python if image else spec.python, str(job_dir), spec.nnodes, gate, opts.health_check_warn
    )
    return batch_lines(
        node_argv=node,
        srun_args=image.srun_args() if image else [],
        judge_argv=image.batch(judge) if image else judge,
        workdir=workdir,
        job_dir=str(job_dir),
        nnodes=spec.nnodes,
        minutes=PULL_TIME_MIN if image else STEP_TIME_MIN,  # an image may be pulled (pyxis: each step)
        retry=retry,
    )
