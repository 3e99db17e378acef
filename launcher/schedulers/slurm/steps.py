"""The checks before training of a SLURM job's batch script, as bash lines for a slot of its template
(the standalone script's, ``launcher.schedulers.slurm.script``) and submitit's setup lines: version
parity and the health gate. Every value is shell-quoted; no step reads a shell variable another sets.

The batch-node halves of the steps are ``launcher.preflight.parity_step`` (compare the probes) and
``launcher.preflight.health_step`` (judge the gate).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from launcher.job.reports import REPORT_DIR_ENV
from launcher.job.spec import JobSpec
from launcher.job.torchrun import IMAGE_PYTHON
from launcher.preflight.health import GATE_TIMEOUT_S, GateSettings
from launcher.preflight.health_step import HEALTH_DIR, HOSTS
from launcher.preflight.parity_step import PROBE_DIR
from launcher.preflight.probe import IMAGE_DIGEST_ENV
from launcher.schedulers.slurm.image import SlurmFacts, SlurmImage
from launcher.schedulers.slurm.options import SlurmOptions

STEP_TIME_MIN = 5  # srun's limit for a check's step: a cold `import torch` takes seconds, not minutes
PULL_TIME_MIN = 30  # in an image, the step may pull it first (several GB for a CUDA image)


def rendezvous(spec: JobSpec) -> tuple[str, int | str]:
    """The job's rendezvous host and port: the spec's, else filled in on the node (``{{first_host}}``, set
    by the controller, and ``{{rdzv_port}}``, from the SLURM job id: ``launcher.job.placeholders``)."""
    return spec.rendezvous.endpoint or "{{first_host}}", spec.rendezvous.port or "{{rdzv_port}}"


def parity_lines(
    spec: JobSpec, facts: SlurmFacts, job_dir: Path, image: SlurmImage | None, nnodes: int
) -> list[str]:
    """Version parity: the probe on each of the allocation's ``nnodes`` nodes (spares included; one srun
    step), compared on the batch node; a mismatch ends the job (exit 3). ``facts.gpus_per_node`` 0: no
    GPU requirement. With ``image``, the probe and the comparison run in the job's image (the probe's
    step may pull it: a longer time limit)."""
    python, workdir, probes = spec.python, facts.workdir, job_dir / PROBE_DIR
    probe = [python, "-m", "launcher.preflight.probe", "--json"]
    minutes = STEP_TIME_MIN
    if image is not None:  # the probe on the image's interpreter
        probe = [*image.srun_args(), *image.run([IMAGE_PYTHON, *probe[1:]])]
        python, minutes = image.python, PULL_TIME_MIN
    srun = [
        "srun", f"--nodes={nnodes}", "--ntasks-per-node=1", f"--time={minutes}", f"--chdir={workdir}",
        f"--output={probes}/node-%n.json", f"--error={probes}/node-%n.log", *probe,
    ]  # fmt: skip
    compare_argv = [
        python, "-m", "launcher.preflight.parity_step", "--job-dir", str(job_dir), "--nodes", str(nnodes),
        "--gpus-per-node", str(facts.gpus_per_node),
        *(["--skip-parity"] if spec.options(SlurmOptions).skip_parity else []),
    ]  # fmt: skip
    if image is not None:
        compare_argv = image.batch(compare_argv)
    q = shlex.quote
    # The image the probe (and, later in the batch script, every node) runs in, as it reports it: pyxis
    # and Apptainer pass the batch environment on (podman sets it itself).
    digest = [f"export {IMAGE_DIGEST_ENV}={q(image.image)}"] if image is not None else []
    return [
        "# Version parity: probe every node (one srun step), compare here; a mismatch ends the job (exit 3).",
        *digest,
        f"rm -rf -- {q(str(probes))} && mkdir -p -- {q(str(probes))}",
        f"{shlex.join(srun)} || true  # a node without a report is named by the comparison",
        f"(cd -- {q(workdir)} && {shlex.join(compare_argv)}) || exit $?",
    ]


def gate_lines(
    spec: JobSpec,
    workdir: str,
    job_dir: Path,
    env: dict[str, str],
    image: SlurmImage | None,
    carry_on: bool = False,
) -> list[str]:
    """The health gate (none without ``--health-check``/``--health-check-warn``): each node runs the
    collective preflight with the gate's stages under torchrun, with the job's environment, ranks per
    node and precision, meeting at the job's rendezvous host and port (free until the job's own
    rendezvous), in the job's image when it has one; judged on the batch node, a node it names ends the
    job (exit 3). ``env`` is the nodes' environment (the Plan's); ``carry_on``: the script goes on to
    the controller, which reads the gate's refusal as its first attempt's (``Transport.refused``) and
    retries without the named nodes (``--retries``)."""
    opts = spec.options(SlurmOptions)
    if not opts.gate:
        return []
    gate = GateSettings.of_job(spec.trainer_args, opts, spec.nproc_per_node)
    judge = [
        image.python if image else spec.python, "-m", "launcher.preflight.health_step",
        "--job-dir", str(job_dir), "--nodes", str(spec.nnodes), "--gpus-per-node", str(gate.gpus_per_node),
        *([f"--min-busbw={gate.min_busbw:g}"] if gate.min_busbw is not None else []),
        *(["--warn"] if opts.health_check_warn else []),
    ]  # fmt: skip
    q = shlex.quote
    health = job_dir / HEALTH_DIR
    srun = [
        "srun", f"--nodes={spec.nnodes}", f"--ntasks={spec.nnodes}", "--ntasks-per-node=1",
        f"--time={PULL_TIME_MIN if image else STEP_TIME_MIN}",  # an image may be pulled (pyxis: each step)
        f"--chdir={workdir}", f"--output={health}/node-%n.out", f"--error={health}/node-%n.log",
        *(image.srun_args() if image else []), *_gate_node(spec, gate, workdir, job_dir, env, image),
    ]  # fmt: skip
    judged = f"(cd -- {q(workdir)} && {shlex.join(image.batch(judge) if image else judge)})"
    on_failure = "exit $?"
    if carry_on:  # the controller retries without the named nodes (its first attempt's refusal)
        on_failure = "echo 'batch: the controller retries without the node(s) the gate named'"
    return [
        "# Health gate: links, compute and GPUs of every node (one srun step), judged here; a node it",
        "# names ends the job before training (exit 3).",
        f"rm -rf -- {q(str(health))} && mkdir -p -- {q(str(health))}",
        # the step's hosts: the allocation's first --nodes (the rest are spares)
        f'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n {spec.nnodes} > {q(str(health / HOSTS))}',
        f"{shlex.join(srun)} || true  # the judgment says what a node without a result printed",
        f"{judged} || {on_failure}",
    ]


def _gate_node(
    spec: JobSpec,
    gate: GateSettings,
    workdir: str,
    job_dir: Path,
    env: dict[str, str],
    image: SlurmImage | None,
) -> list[str]:
    """Each node's command of the gate: the workers under torchrun, behind ``launcher.job.node``."""
    torchrun = gate.worker_argv(spec.nnodes, "{{node_rank}}", rendezvous(spec), GATE_TIMEOUT_S)
    # The environment is set before the node entry, which fills in placeholders in its argv only, as
    # the job's own environment is never filled in. The workers report into the gate's directory.
    env = env | {REPORT_DIR_ENV: str(job_dir / HEALTH_DIR)}
    assignments = ["env", *(f"{k}={v}" for k, v in sorted(env.items()))]
    entry = ["-m", "launcher.job.node", "--workdir", workdir, "--"]
    if image is None:
        return [*assignments, spec.python, *entry, spec.python, *torchrun]
    if image.runtime == "podman":  # the entry on the host, the workers in a container
        workers = image.run([IMAGE_PYTHON, *torchrun], env_names=sorted(env))
        return [*assignments, image.host_python, *entry, *workers]
    # pyxis (srun's options) and apptainer (a prefix): the whole task in the image
    return image.wrap([*assignments, IMAGE_PYTHON, *entry, IMAGE_PYTHON, *torchrun])
