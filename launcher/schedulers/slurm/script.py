"""The sbatch side of a SLURM job, rendered without side effects: the sbatch options, and the standalone
sbatch script that ``launcher render --scheduler slurm`` prints, which runs the job as ``launcher
submit`` does (docs/schedulers/slurm.md, "Two paths"). Every value comes out shell-quoted; secrets are
never in it (SLURM exports the submitting shell's environment to the job).
"""

from __future__ import annotations

import re
import shlex

from gptlaunch import package_version
from gptlaunch.contract import EXIT_USAGE, FIRST_HOST_ENV
from launcher.job.spec import JobSpec, SpecError
from launcher.schedulers.slurm.options import SlurmOptions
from launcher.supervisor.supervisor import SUPERVISE

# The allocation's first host (the rendezvous), for every task: where the node command runs (in an
# image), scontrol may be missing.
FIRST_HOST_LINE = f'export {FIRST_HOST_ENV}=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
NEEDED = "this project (trainer, launcher.job.node) and torch"


def sbatch_options(spec: JobSpec, opts: SlurmOptions, job_id: str, gpus_per_node: int) -> dict[str, str]:
    """sbatch's options for this job, ``{name: value}`` ("" for a bare flag), in a stable order.
    ``gpus_per_node`` 0 requests no GPUs."""
    out = {
        "job-name": job_id,
        "nodes": str(spec.nnodes + opts.spare_nodes),
        "ntasks-per-node": "1",  # one torchrun agent per node; it starts nproc_per_node ranks
        "time": str(opts.time_min),
    }
    for key, value in (
        ("partition", opts.partition),
        ("account", opts.account),
        ("qos", opts.qos),
        ("constraint", opts.constraint),
        ("cpus-per-task", opts.cpus_per_task),
        ("mem", opts.mem),
    ):
        if value is not None:
            out[key] = str(value)
    if gpus_per_node:
        out["gpus-per-node"] = str(gpus_per_node)
    out["signal"] = f"USR2@{opts.signal_delay_s}"
    out["no-kill"] = ""  # a failed node does not end the allocation: the controller goes on without it
    return out | opts.sbatch


def _sbatch_line(key: str, value: str) -> str:
    return f"#SBATCH --{key}" if value == "" else f"#SBATCH --{key}={shlex.quote(value)}"


_NO_WORKDIR = (
    "batch: workdir %s is not a directory on %s: create it on every node (a shared filesystem) "
    "or pass another --workdir\\n"
)

# The standalone script. Each @slot@ is filled with lines of ``steps`` or of this module.
TEMPLATE = """\
#!/bin/bash
@header@
@sbatch@
#SBATCH --requeue
#SBATCH --export=ALL

set -uo pipefail
mkdir -p -- @job_dir@

# The job record (what `launcher status`, `logs` and `wait` read), written by the job's first run; a
# requeued run finds it and goes on with its attempts.
@record@

# SLURM's warning before a time limit or preemption (SIGUSR2) reaches the ranks, which checkpoint
# and exit; `scancel --signal=USR2 --full` also sends it to this shell, which must outlive it.
trap 'echo "batch: SIGUSR2: the ranks checkpoint and stop"' USR2
@environment@
@workdir@

@checks@

# The job's controller, as `launcher submit` runs it: each node's agent a job step (a torchrun agent,
# meeting at node 0's host), fail-fast, retries, a requeue after a checkpoint on SLURM's warning,
# and the job's end in its record; its exit code is the job's.
@controller@
"""
SLOT = re.compile(r"@([a-z_]+)@")


def fill(template: str, slots: dict[str, str]) -> str:
    """``template`` with each ``@name@`` replaced by ``slots[name]`` (not scanned again). Raises
    ValueError for a slot left unfilled or a value for no slot."""
    named = set(SLOT.findall(template))
    if named != set(slots):
        raise ValueError(f"slots {sorted(named)} and values {sorted(slots)} differ")
    return SLOT.sub(lambda m: slots[m.group(1)], template)


def sbatch_script(
    spec: JobSpec,
    *,
    job_id: str,
    options: dict[str, str],
    job_dir: str,
    workdir: str,
    checks: list[str],
    record: str,
    image: list[str] | None = None,
) -> str:
    """The standalone sbatch script of ``spec`` (``TEMPLATE``). ``checks``, the steps before training
    (``steps.parity_lines``, ``steps.gate_lines``); ``record``, the job record as one JSON line;
    ``image``, the header's lines on how the nodes run the job's image. Raises SpecError for a job
    directory that srun's file name patterns would rewrite."""
    if "%" in job_dir or "\\" in job_dir:
        raise SpecError(f"the job directory {job_dir!r} contains % or \\: choose --job-dir without them")
    q = shlex.quote
    secret_names = ", ".join(spec.secret_env) or "none"
    world = f"{spec.nnodes} node(s) × {spec.nproc_per_node} process(es) = world_size {spec.world_size}"
    header = [
        f"# GPT training job {job_id}: {world}, one torchrun agent per node.",
        f"# Rendered by `launcher render --scheduler slurm` (gptlaunch {package_version()}).",
        "# Submit it with `sbatch THIS_FILE`; SLURM prints the job id; the login node needs sbatch.",
        *(image or [f"# The nodes need the interpreter below with {NEEDED}."]),
        f"# Secrets ({secret_names}) are not written here: export them in the shell that runs sbatch,",
        "# which SLURM passes on to the job (--export=ALL).",
    ]
    no_workdir = f'{{ printf {q(_NO_WORKDIR)} {q(workdir)} "$(hostname)"; exit {EXIT_USAGE}; }}'
    write = [spec.python, "-m", "launcher.schedulers.slurm.controller", "--job-dir", job_dir]
    slots = {
        "header": header,
        "sbatch": [_sbatch_line(k, v) for k, v in options.items()],
        "job_dir": [q(job_dir)],
        "record": [f"{shlex.join(write)} <<'RECORD' || exit $?", record, "RECORD"],
        "environment": [FIRST_HOST_LINE],
        "workdir": [f"cd -- {q(workdir)} || {no_workdir}"],
        "checks": checks,
        "controller": [shlex.join([spec.python, *SUPERVISE, "--job-dir", job_dir])],
    }
    return fill(TEMPLATE, {name: "\n".join(lines) for name, lines in slots.items()})
