"""The SLURM scheduler's options."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from launcher.job.options import ContainerOptions, Flag, GateOptions, Placeholder

if TYPE_CHECKING:
    from launcher.job.spec import JobSpec

# sbatch options the launcher sets itself (or that have their own field): not for the pass-through.
SBATCH_MANAGED = {
    "nodes": "--nodes",
    "ntasks": "--nodes",
    "ntasks-per-node": "--nodes",
    "job-name": "--name",
    "output": "the job record",
    "error": "the job record",
    "open-mode": "the job record",
    "signal": "signal_delay_s",
    "requeue": "max_requeues",
    "export": "secret_env",
    "wrap": "the trainer arguments",
    "parsable": "the launcher's own parsing of sbatch",
    "test-only": "--dry-run",
    "wait": "--wait",
    "no-requeue": "max_requeues",
    "array": "one job per submit",
    "time": "--time",
    "partition": "--partition",
    "account": "--account",
    "qos": "--qos",
    "constraint": "--constraint",
    "cpus-per-task": "--cpus-per-task",
    "mem": "--mem",
    "gpus-per-node": "--gpus-per-node and scheduler.gpus",
}


# {{rdzv_port}}: PORT_BASE + SLURM_JOB_ID mod PORT_SPAN. Concurrent jobs whose first node is the same
# get different ports (unless their ids differ by a multiple of PORT_SPAN), below Linux's ephemeral
# range (32768-60999) so that no outgoing connection holds it.
PORT_BASE, PORT_SPAN = 15000, 15000


def _slurm_job_id(env: Mapping[str, str]) -> str:
    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job_id!r} is not a SLURM job id (is this a SLURM job?)")
    return job_id


def _rdzv_port(env: Mapping[str, str]) -> str:
    return str(PORT_BASE + int(_slurm_job_id(env)) % PORT_SPAN)


PLACEHOLDERS = {
    "slurm_job_id": Placeholder(_slurm_job_id, "SLURM_JOB_ID, the same across requeues: the rendezvous id"),
    "rdzv_port": Placeholder(_rdzv_port, f"{PORT_BASE} + SLURM_JOB_ID mod {PORT_SPAN}: the rendezvous port"),
}


def slurm_minutes(value: str) -> int:
    """Minutes (rounded up) of a SLURM time limit in any of sbatch's forms: ``MM``, ``MM:SS``,
    ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``. Raises ValueError for anything else or 0."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a SLURM time: use minutes (90) or HH:MM:SS (1:30:00)")
    days, a, b, c = (int(x or 0) for x in match.groups())
    mm_ss = match[1] is None and match[4] is None  # MM[:SS]; else D-HH[:MM[:SS]] or HH:MM:SS
    seconds = a * 60 + b if mm_ss else days * 86400 + a * 3600 + b * 60 + c
    if seconds <= 0:
        raise ValueError(f"{value!r} is no time at all: give a positive time limit")
    return math.ceil(seconds / 60)


def time_note(value: str) -> str | None:
    """What a time limit in SLURM's ``MM:SS`` form means, said, since ``4:00`` reads as hours: None
    for the other forms."""
    match = re.fullmatch(r"(\d+):(\d+)", value.strip())
    if match is None:
        return None
    minutes, seconds = (int(x) for x in match.groups())
    return (
        f"--time {value} is {minutes} minute(s) {seconds} second(s) (SLURM's MM:SS); for {minutes} hours "
        f"say {minutes}:{seconds:02d}:00"
    )


class SlurmOptions(ContainerOptions, GateOptions):
    """The SLURM scheduler: one allocation of ``nnodes`` nodes, one task (one torchrun agent) per node,
    submitted through submitit (or as a standalone sbatch script)."""

    runtimes: ClassVar[tuple[str, ...]] = ("pyxis", "apptainer", "podman")
    scheduler: ClassVar[str] = "launcher.schedulers.slurm.scheduler:SlurmScheduler"
    placeholders: ClassVar[dict[str, Placeholder]] = PLACEHOLDERS
    kind: Literal["slurm"] = Field("slurm", description="where the job runs (slurm: a SLURM cluster)")
    partition: str | None = Field(None, description="SLURM partition (default: the cluster's default)")
    time: str = Field(
        "60",
        description="time limit: minutes (90) or HH:MM:SS (D-HH:MM:SS); before it ends the ranks "
        "checkpoint and the job is requeued (see max_requeues)",
    )
    account: str | None = Field(None, description="SLURM account to charge")
    qos: str | None = Field(None, description="SLURM quality of service")
    constraint: str | None = Field(None, description="SLURM node features required, e.g. a100&ib")
    cpus_per_task: int | None = Field(
        None, ge=1, description="CPUs for each node's task (its torchrun agent and all its ranks)"
    )
    mem: str | None = Field(None, description="memory per node, e.g. 64G (SLURM's --mem; default unit MB)")
    gpus: Annotated[bool | None, Flag("--slurm-gpus")] = Field(
        None,
        description="request --gpus-per-node from SLURM (true, false: CPU processes; default: when the "
        "partition's nodes have GPUs, from sinfo)",
    )
    signal_delay_s: int = Field(
        90,
        ge=10,
        description="seconds before a time limit or preemption that SLURM sends SIGUSR2 (the ranks "
        "checkpoint, the job is requeued); USR1 is avoided, NCCL may use it",
    )
    max_requeues: int = Field(
        3,
        ge=0,
        description="requeues after reaching the time limit (through submitit preemptions are not "
        "counted; the standalone sbatch script counts every requeue)",
    )
    spare_nodes: int = Field(
        0,
        ge=0,
        description="nodes allocated beyond --nodes, idle until a node fails: a retry (--retries) then "
        "runs at once on a spare, in the same allocation, with no requeue and no second wait in the queue; "
        "the failed node (or one the health gate named) is left out of the rest of the job, and once no "
        "spare is left a retry is a requeue (launcher submit; the standalone sbatch script has no retries)",
    )
    node_local_run_dir: bool | None = Field(
        None,
        description="the run dir is on each node's own disk, not on the file system the nodes share: "
        "each node copies its saves into the job record (JOB/run-copy) and restores that copy before its "
        "ranks start, so a checkpoint survives a lost node (default: when the nodes do not see the mark "
        "the launcher writes in the run dir at submit; the standalone sbatch script needs it said)",
    )
    sbatch: Annotated[dict[str, str], Flag("--slurm-opt", metavar="KEY[=VALUE]")] = Field(
        default_factory=dict,
        description="any other sbatch option, e.g. mail-type=END or exclusive (repeatable; in a config "
        "file: {exclusive: '', mail-type: END}, '' for a bare flag)",
    )

    @field_validator("partition", "account", "qos", "constraint")
    @classmethod
    def _word(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[^\s\x00-\x1f\x7f]+", v):
            raise ValueError("must be non-empty, without spaces or control characters")
        return v

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        slurm_minutes(v)
        return v

    @field_validator("mem")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"\d+[KMGT]?", v):
            raise ValueError(f"{v!r} is not a SLURM memory size: use 64G, 512M or a number of MB")
        return v

    @field_validator("sbatch", mode="before")
    @classmethod
    def _flags(cls, v: Any) -> Any:
        # YAML `exclusive: true` means the bare flag `--exclusive`.
        return {k: "" if x is True else x for k, x in v.items()} if isinstance(v, dict) else v

    @field_validator("sbatch")
    @classmethod
    def _sbatch(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not re.fullmatch(r"[a-z][a-z0-9-]*", key):
                raise ValueError(f"{key!r} is not an sbatch option name (like mail-type, without --)")
            if key in SBATCH_MANAGED:
                raise ValueError(f"sbatch option {key!r} is set by the launcher: use {SBATCH_MANAGED[key]}")
            if any(ord(c) < 32 or ord(c) == 127 for c in value):
                raise ValueError(f"the value of sbatch option {key!r} contains a control character")
        return v

    @property
    def time_min(self) -> int:
        """The time limit in minutes (rounded up)."""
        return slurm_minutes(self.time)

    def check_job(self, job: JobSpec) -> None:
        if self.time_min * 60 <= self.signal_delay_s + 60:
            raise ValueError(
                f"scheduler.time {self.time!r} leaves under a minute before SLURM's warning "
                f"{self.signal_delay_s} s before the end (signal_delay_s): give a longer --time"
            )
        if self.signal_delay_s <= job.grace_period_s:
            raise ValueError(
                f"signal_delay_s ({self.signal_delay_s}) must exceed grace_period_s "
                f"({job.grace_period_s:g}): the ranks need that long to checkpoint before SLURM stops it"
            )
        if self.spare_nodes and not job.retries:
            raise ValueError("--spare-nodes needs --retries N (N ≥ 1): a spare node is used by a retry")
