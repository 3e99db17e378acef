"""The sbatch side of a SLURM job, rendered without side effects: the sbatch options, and the standalone
sbatch script that `launcher render --scheduler slurm` prints.

The script behaves as a job submitted through submitit does: one task per node, each running the node's
command (the node task with its hang watchdog, ``launcher.schedulers.slurm.task``, starting a torchrun
agent behind ``python -m launcher.job.node``, which fills in the first host, the rendezvous port and id
from SLURM's variables), node logs in the job directory, fail-fast
(``srun --kill-on-bad-exit=1``), and on SLURM's warning signal (SIGUSR2, ``--signal=USR2@T``) the ranks
checkpoint and the script requeues the job, which resumes from that checkpoint. Every value comes out
shell-quoted; secrets are never in it (SLURM exports the submitting shell's environment to the job).
"""

from __future__ import annotations

import re
import shlex

from gptlaunch import package_version
from gptlaunch.contract import EXIT_USAGE, FIRST_HOST_ENV
from launcher.job.plan import NodePlan
from launcher.job.spec import JobSpec, SpecError
from launcher.schedulers.slurm.options import SlurmOptions
from launcher.schedulers.slurm.steps import SET_RUN_STARTED

# srun's file name patterns: %n is the node's index within the job (one log per node).
NODE_LOG_PATTERN = "node-%n.log"
SRUN_ARGS = ["--kill-on-bad-exit=1"]  # one node's failure ends the job (fail fast)
# The allocation's first host (the rendezvous), for every task: where the node command runs (in an
# image), scontrol may be missing.
FIRST_HOST_LINE = f'export {FIRST_HOST_ENV}=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
NEEDED = "this project (trainer, launcher.job.node) and torch"
NO_RETRIES = "# --retries needs `launcher submit` (it keeps the job record): this script does not retry."
NO_SPARES = "# --spare-nodes needs `launcher submit` (its retry step): this script allocates no spare node."


def sbatch_options(spec: JobSpec, opts: SlurmOptions, job_id: str, gpus_per_node: int) -> dict[str, str]:
    """sbatch's options for this job, ``{name: value}`` ("" for a bare flag), in a stable order.
    ``gpus_per_node`` 0 requests no GPUs."""
    out = {
        "job-name": job_id,
        "nodes": str(spec.nnodes),
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
    return out | opts.sbatch


def _sbatch_line(key: str, value: str) -> str:
    return f"#SBATCH --{key}" if value == "" else f"#SBATCH --{key}={shlex.quote(value)}"


_NO_WORKDIR = (
    "batch: workdir %s is not a directory on %s: create it on every node (a shared filesystem) "
    "or pass another --workdir\\n"
)

# The standalone script. Each @slot@ is filled with lines of ``steps`` or of this module; the script's
# only shell variable, $run_started, is set here and handed to the steps that need it.
TEMPLATE = """\
#!/bin/bash
@header@
@sbatch@
#SBATCH --requeue
#SBATCH --export=ALL

set -uo pipefail
mkdir -p -- @job_dir@

# SLURM's warning before a time limit or preemption (SIGUSR2) reaches the ranks, which checkpoint
# and exit; `scancel --signal=USR2 --full` also sends it to this shell, which must outlive it.
trap 'echo "batch: SIGUSR2: the ranks checkpoint and stop"' USR2
@set_run_started@

# Environment of every node's processes (the submitting shell's is exported too).
@environment@
@workdir@

@checks@

# One task per node; each runs a torchrun agent, meeting at a c10d rendezvous on the first node.
# When a node fails, the last step names the cause, exits with its code, and requeues the job after
# a checkpoint on SLURM's warning signal.
@node_step@ || \\
  @end@
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
    *,
    job_id: str,
    options: dict[str, str],
    node: NodePlan,
    job_dir: str,
    world: str,
    secrets: list[str],
    checks: list[str],
    end: list[str],
    retries: int = 0,
    spares: int = 0,
    srun_args: list[str] | None = None,
    image: list[str] | None = None,
) -> str:
    """The standalone sbatch script (``TEMPLATE``). ``node`` is the command every node runs (the same on
    every node: what differs is filled in on the node); ``world`` describes the job's size for the
    header; ``checks``, the steps before training (``steps.parity_lines``, ``steps.gate_lines``);
    ``end``, the step after a failed node step (``steps.end_lines``); ``srun_args``, the node step's
    extra srun options (pyxis's container options); ``image``, the header's lines on how the nodes run
    the job's image. Raises SpecError for a job directory that srun's file name patterns would
    rewrite."""
    if "%" in job_dir or "\\" in job_dir:
        raise SpecError(f"the job directory {job_dir!r} contains % or \\: choose --job-dir without them")
    q = shlex.quote
    srun = [
        "srun",
        f"--nodes={options['nodes']}",
        "--ntasks-per-node=1",
        *SRUN_ARGS,
        *(srun_args or []),
        f"--output={job_dir}/{NODE_LOG_PATTERN}",
        "--open-mode=append",  # a requeued run adds to the same node logs
        *node.argv,
    ]
    secret_names = ", ".join(secrets) or "none"
    header = [
        f"# GPT training job {job_id}: {world}, one torchrun agent per node.",
        f"# Rendered by `launcher render --scheduler slurm` (gptlaunch {package_version()}).",
        "# Submit it with `sbatch THIS_FILE`; SLURM prints the job id; the login node needs sbatch.",
        *(image or [f"# The nodes need the interpreter below with {NEEDED}."]),
        f"# Secrets ({secret_names}) are not written here: export them in the shell that runs sbatch,",
        "# which SLURM passes on to the job (--export=ALL).",
        *([NO_RETRIES] if retries else []),
        *([NO_SPARES] if spares else []),
    ]
    no_workdir = f'{{ printf {q(_NO_WORKDIR)} {q(node.cwd)} "$(hostname)"; exit {EXIT_USAGE}; }}'
    slots = {
        "header": header,
        "sbatch": [_sbatch_line(k, v) for k, v in options.items()],
        "job_dir": [q(job_dir)],
        "set_run_started": [SET_RUN_STARTED],
        "environment": [*(f"export {k}={q(v)}" for k, v in sorted(node.env.items())), FIRST_HOST_LINE],
        "workdir": [f"cd -- {q(node.cwd)} || {no_workdir}"],
        "checks": checks,
        "node_step": [" \\\n  ".join(shlex.join(srun[i : i + 6]) for i in range(0, len(srun), 6))],
        "end": end,
    }
    return fill(TEMPLATE, {name: "\n".join(lines) for name, lines in slots.items()})
