"""The torchrun command line of one node, from a JobSpec (pure)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from gptlaunch.contract import JOB_ID_ENV, RESUME_ARGS_ENV, RETRIES_ENV, RUN_DIR_ENV, RUN_ID_ENV, SWEEP_ID_ENV
from launcher.job.options import ContainerOptions
from launcher.job.record import torchelastic_dir
from launcher.job.spec import JobSpec, RendezvousSpec, SpecError

# Worker lines reach the node log as "[rank3]: ..." (torchrun's --tee with a line-prefix template).
LOG_LINE_PREFIX = "[rank${rank}]: "
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"


IMAGE_PYTHON = "python"  # the interpreter of the training image (the Dockerfile's venv, on its PATH)


def node_agents(
    spec: JobSpec,
    *,
    endpoint: str,
    job_id: str,
    job_dir: Path,
    worker: list[str],
    python: str | None = None,
) -> list[list[str]]:
    """``python -m torch.distributed.run ... WORKER`` of every node k of the job; ``worker`` is what
    each rank runs, in torchrun's form (``worker_argv``), and node k's error files go to
    ``torchelastic_dir(job_dir, k)``.

    ``endpoint`` is ``host:port`` of the rendezvous store (it may hold placeholders); the rendezvous id
    is the spec's, else the job id, and the backend ``rdzv_backend``'s. With c10d the agents agree on
    node ranks themselves, so ``--node-rank`` is passed only for the static backend (torchrun ignores
    it otherwise, with a warning), whose ``--rdzv-conf`` takes the join timeout as ``timeout``.
    ``python`` is the interpreter (default: the spec's; ``IMAGE_PYTHON`` in the training image).
    """
    rdzv = spec.rendezvous
    backend = rdzv_backend(rdzv)
    conf = (
        f"timeout={rdzv.join_timeout_s}"
        if backend == "static"
        else f"join_timeout={rdzv.join_timeout_s},last_call_timeout={rdzv.last_call_timeout_s}"
    )
    argv = [
        python or spec.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv.id or job_id}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={rdzv.max_restarts}",
        # SIGUSR2 is SLURM's usual pre-timeout warning: the agent must forward it, not die of it.
        f"--signals-to-handle={FORWARDED_SIGNALS}",
    ]
    return [
        [
            *argv,
            f"--log-dir={torchelastic_dir(job_dir, k)}",
            "--tee=3",
            *([f"--node-rank={k}"] if backend == "static" else []),
            *worker,
        ]
        for k in range(spec.nnodes)
    ]


def rdzv_backend(rdzv: RendezvousSpec) -> str:
    """``rdzv.backend``, with ``auto`` made static where node 0 holds the store (no
    ``--rdzv-endpoint``), else c10d. The launcher renders every node's rank (each scheduler's node
    agents are ``node_agents``), so static always can number them.

    Why static where it can be: c10d's agents poll the store once a second while they wait for each
    other (torch 2.13, ``dynamic_rendezvous``: ``_delay(seconds=1)`` on each sync, after a random
    0-0.3 s on joining), which cost about 1.2 s of every attempt's start: a warm SSH retry's torchrun
    reached its workers in 2.4 s with c10d and 1.1-1.3 s with static (3 hosts, 2-core machine). The
    launcher ends and retries the whole job on any failure, so nothing needs c10d's agreement on ranks.
    """
    if rdzv.backend != "auto":
        return rdzv.backend
    return "static" if rdzv.endpoint is None else "c10d"


RUN_DIR_ARG = "{{run_dir}}"  # in a program's arguments: the job's run dir, replaced when the Plan is made


def worker_argv(spec: JobSpec, default_run_dir: Path) -> tuple[list[str], str]:
    """What every rank runs, after torchrun's own flags, and the job's run dir: ``-m trainer.cli train
    ARGS`` with ``--run-dir`` added when absent, or the user's program (``JobSpec.program``), whose
    run dir is ``default_run_dir`` (``RUN_DIR_ENV`` tells it, and ``RUN_DIR_ARG`` in its arguments
    becomes it: ``--out {{run_dir}}`` for a script that takes its checkpoint dir as an argument)."""
    run_dir, args = str(default_run_dir), spec.trainer_args
    if spec.program is not None:
        return [arg.replace(RUN_DIR_ARG, run_dir) for arg in spec.program.argv()], run_dir
    if (asked := trainer_flag(args, "--run-dir")) is not None:
        return ["-m", "trainer.cli", "train", *args], asked
    return ["-m", "trainer.cli", "train", *args, "--run-dir", run_dir], run_dir


def warm_workers(spec: JobSpec) -> bool:
    """Whether ``spec``'s ranks fork from a warm process (``scheduler.warm_workers``, ``gptlaunch.warm``):
    as asked, else where they pay: on the local and SSH schedulers, when a retry may follow
    (``retries`` > 0: only a retry's ranks start once the zygote is ready), the program is Python and
    runs on the host (no ``image``: the zygote is the host's Python, not the image's)."""
    asked = getattr(spec.scheduler, "warm_workers", False)
    if asked is not None:
        return bool(asked)
    python = spec.program is None or spec.program.kind != "no_python"
    bare = getattr(spec.scheduler, "image", None) is None
    return spec.scheduler.kind in ("local", "ssh") and spec.retries > 0 and python and bare


def check_warm_program(spec: JobSpec) -> None:
    """Raise SpecError when ``spec`` asks for warm workers (``scheduler.warm_workers``) and a program
    that is not Python: a forked rank runs Python code."""
    warm = getattr(spec.scheduler, "warm_workers", False)
    if warm and spec.program is not None and spec.program.kind == "no_python":
        raise SpecError(
            "scheduler.warm_workers (--warm-workers) forks Python ranks; a --no-python program "
            "starts its own interpreter: drop --warm-workers"
        )


def zygote_name(job_id: str) -> str:
    """The abstract socket (``@NAME``, ``gptlaunch.warm``) of ``job_id``'s zygote on each SSH host."""
    return "@gptlaunch-warm-" + hashlib.sha256(job_id.encode()).hexdigest()[:16]


def zygote_serve(job_id: str) -> list[str]:
    """What follows the interpreter in the command line of ``job_id``'s zygote on an SSH host: how it
    is started, and how a node's KILL tells it from the processes that only name its socket."""
    return ["-m", "gptlaunch.warm", "serve", zygote_name(job_id)]


def warm_worker(worker: list[str], socket: str) -> list[str]:
    """What torchrun runs for each rank instead of ``worker`` (``-m MODULE ARGS`` or ``SCRIPT ARGS``)
    with ``--warm-workers``: the client that has the zygote on ``socket`` fork the rank
    (``gptlaunch.warm``)."""
    return ["-m", "gptlaunch.warm", "run", socket, "--", *worker]


def agent_env(spec: JobSpec, job_id: str, omp_num_threads: int | None, run_dir: str) -> dict[str, str]:
    """The environment every node's torchrun agent (and so every rank) gets from the Plan: the
    network settings, the thread count (None: torchrun's default), the job id that marks the job's
    processes, the run dir (``gptlaunch.runtime.checkpoint_dir``), the retries (``runtime.may_retry``),
    the run id for trackers (``RUN_ID_ENV``, W&B's ``WANDB_RUN_ID``) and the rank prefix of every
    worker line."""
    return {
        "PYTHONUNBUFFERED": "1",
        # A tracker's run that stays one run across attempts, retries and requeues (the job id does);
        # the user's own values (--env) win.
        RUN_ID_ENV: job_id,
        "WANDB_RUN_ID": job_id,
        "WANDB_RESUME": "allow",
        **({SWEEP_ID_ENV: spec.sweep_id, "WANDB_RUN_GROUP": spec.sweep_id} if spec.sweep_id else {}),
        **spec.network.as_env(),
        **({"OMP_NUM_THREADS": str(omp_num_threads)} if omp_num_threads else {}),
        JOB_ID_ENV: job_id,
        RUN_DIR_ENV: run_dir,
        **({RETRIES_ENV: str(spec.retries)} if spec.retries else {}),
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LOG_LINE_PREFIX,
        # Seconds torchrun lets workers checkpoint after forwarding a signal, before SIGKILL. The
        # variable behind --shutdown-timeout, not the flag: torch 2.11 (seen on an H200 machine) has no
        # such flag and refuses to start; it ignores the variable and waits its default 30 s.
        "PET_SHUTDOWN_TIMEOUT": str(max(1, math.ceil(spec.grace_period_s))),
        **(
            {RESUME_ARGS_ENV: json.dumps(resume)}
            if (resume := spec.program and spec.program.resume_args)
            else {}
        ),
    }


def copy_excludes(spec: JobSpec, workdir: str, run_dir: str) -> tuple[str, ...]:
    """The dirs below the (absolute) run dir that its copy leaves out (``launcher.agent.copies``): the
    built-in trainer's prepared data, which each node makes for itself (the ranks check that their
    tokenizers agree); none for a user's program."""
    if spec.program is not None:
        return ()
    data = trainer_flag(spec.trainer_args, "--data-dir")
    data_dir = Path(os.path.normpath(Path(workdir) / data if data is not None else Path(run_dir) / "data"))
    run = Path(os.path.normpath(run_dir))
    return (data_dir.relative_to(run).as_posix(),) if data_dir != run and data_dir.is_relative_to(run) else ()


def container_mounts(spec: JobSpec, run_dir: str, workdir: str, job_dir: Path) -> tuple[str, ...]:
    """The host directories a node's container mounts, each at its own path, so that every path in the
    Plan means the same inside the image as on the host: the job record, the run dir, the workdir, the
    trainer's data, text-file and checkpoint directories (relative ones are the workdir's) and the
    options' ``container_mounts``; each once, none that another one holds, never ``/``, sorted. Raises
    SpecError for a path with ':' or ',' (the runtimes' separators: ``--volume P:P``,
    ``--container-mounts A:A,B:B``), and what ``trainer.precheck.paths_of`` raises."""
    # Imported here: trainer.precheck loads the trainer's config and data modules, which the agent,
    # the preflight checks and the CLI's other commands import this module without needing.
    from trainer.precheck import paths_of

    args = [*spec.trainer_args, "--run-dir", run_dir]  # the paths to mount (a program has none)
    extra = spec.options(ContainerOptions).container_mounts
    base = Path(workdir)
    wanted = [job_dir, base, *(base / p for p in paths_of(args)), *map(Path, extra)]
    by_depth = sorted({Path(os.path.normpath(p)) for p in wanted} - {Path("/")}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in by_depth:
        if not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    for path in kept:
        if ":" in str(path) or "," in str(path):
            raise SpecError(f"the container mount {path} contains ':' or ',': choose paths without them")
    return tuple(sorted(str(p) for p in kept))


def trainer_flag(trainer_args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in the trainer arguments (``--flag X`` or ``--flag=X``; the last wins,
    as in argparse), or None when absent."""
    value: str | None = None
    for i, arg in enumerate(trainer_args):
        if arg == flag and i + 1 < len(trainer_args):
            value = trainer_args[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value
