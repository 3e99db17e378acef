"""Options that belong to one scheduler, one model each, joined in ``SchedulerOptions``.

A job config says ``scheduler: {kind: local, gpus: [0, 1]}`` (or just ``scheduler: local``); the
``kind`` picks the model, so options of another scheduler are rejected by name. Adding a scheduler
adds its model to the union here and its module to ``launcher.schedulers.SCHEDULERS``; this module
imports neither (the spec must not import the schedulers, which import the spec).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from launcher.schedulers.ssh.client import SSH_OPT_RE, check_host

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


class LocalOptions(BaseModel):
    """The local scheduler: ``nnodes`` emulated nodes on this machine."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["local"] = Field(
        "local", description="where the job runs (local: emulated nodes on this machine)"
    )
    gpus: list[str] | None = Field(
        None,
        description="ids of the GPUs shared out between emulated nodes, [] for none (default: those "
        "in CUDA_VISIBLE_DEVICES (--env or this shell), else all detected)",
    )

    @field_validator("gpus")
    @classmethod
    def _gpu_ids(cls, v: list[str] | None) -> list[str] | None:
        for gpu in v or []:
            if not re.fullmatch(r"[A-Za-z0-9-]+", gpu):
                raise ValueError(f"{gpu!r} is not a GPU id (an index like 0 or a UUID like GPU-8f3c...)")
        return v


def slurm_minutes(value: str) -> int:
    """Minutes (rounded up) of a SLURM time limit in any of sbatch's forms: ``MM``, ``MM:SS``,
    ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``. Raises ValueError for anything else or 0."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a SLURM time: use minutes (90) or HH:MM:SS (1:30:00)")
    days, a, b, c = (int(x) if x is not None else None for x in match.groups())
    assert a is not None
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # HH:MM:SS
        seconds = a * 3600 + (b or 0) * 60 + c
    else:  # MM[:SS]
        seconds = a * 60 + (b or 0)
    if seconds <= 0:
        raise ValueError(f"{value!r} is no time at all: give a positive time limit")
    return math.ceil(seconds / 60)


SKIP_PARITY_HELP = (
    "train even when the nodes' versions differ (the diff is still printed); by default the job is "
    "refused (ssh) or ends before training (slurm, compose) with exit code 3"
)


class SlurmOptions(BaseModel):
    """The SLURM scheduler: one allocation of ``nnodes`` nodes, one task (one torchrun agent) per node,
    submitted through submitit (or as a standalone sbatch script)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
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
    gpus: bool | None = Field(
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
    skip_parity: bool = Field(False, description=SKIP_PARITY_HELP)
    sbatch: dict[str, str] = Field(
        default_factory=dict,
        description="other sbatch options, e.g. {exclusive: '', mail-type: END} ('' for a bare flag)",
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


class SshOptions(BaseModel):
    """The SSH scheduler: one torchrun agent per host, started through the system OpenSSH client."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["ssh"] = Field("ssh", description="where the job runs (ssh: hosts reached by ssh)")
    hosts: list[str] = Field(
        default_factory=list,
        description="hosts, [user@]host or ~/.ssh/config aliases; the first --nodes of them run the job, "
        "the first hosts the rendezvous (or hostfile)",
    )
    hostfile: Path | None = Field(
        None, description="file of hosts, one `host [slots=N]` per line, # comments (or hosts)"
    )
    ssh_opts: list[str] = Field(
        default_factory=list, description="extra ssh options KEY=VALUE (ssh -o), e.g. ProxyJump=bastion"
    )
    host_key_check: Literal["yes", "accept-new"] = Field(
        "yes",
        description="StrictHostKeyChecking: yes (a host must be in known_hosts) or accept-new (record "
        "the key of a host seen for the first time; a changed key is still refused)",
    )
    connect_timeout_s: int = Field(10, ge=1, le=300, description="seconds to wait for each ssh connection")
    skip_parity: bool = Field(False, description=SKIP_PARITY_HELP)
    preflight: bool = Field(
        False, description="before training, run a short all_reduce across the hosts and report bandwidth"
    )

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        for host in v:
            check_host(host)
        if len(set(v)) != len(v):
            raise ValueError("a host is listed twice")
        return v

    @field_validator("ssh_opts")
    @classmethod
    def _opts(cls, v: list[str]) -> list[str]:
        for option in v:
            if not SSH_OPT_RE.fullmatch(option):
                raise ValueError(f"{option!r} is not an ssh option: use KEY=VALUE, e.g. Port=2222")
            instead = SSH_MANAGED.get(option.split("=", 1)[0].lower())
            if instead:
                raise ValueError(f"ssh option {option!r} is set by the launcher: use {instead}")
        return v

    @model_validator(mode="after")
    def _one_host_list(self) -> SshOptions:
        if bool(self.hosts) == (self.hostfile is not None):
            raise ValueError(
                "give the hosts either as hosts (--hosts h1,h2) or as a hostfile (--hostfile FILE)"
            )
        return self


class ComposeOptions(BaseModel):
    """The compose scheduler: one container of the training image per node, on a private network of
    one Docker engine (docker compose v2 or docker-compose v1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["compose"] = Field(
        "compose", description="where the job runs (compose: one container per node, docker compose)"
    )
    image: str = Field(
        "",
        validate_default=True,
        description="the training image every node runs (`launcher build`), by name or id (required)",
    )
    shm_size: str = Field(
        "8g",
        description="shared memory of each container (Docker's 64m default breaks NCCL)",
    )
    gpus: bool | None = Field(
        None,
        description="reserve --gpus-per-node GPUs for each container (default: when the engine has the "
        "nvidia runtime)",
    )
    compose_command: Literal["auto", "docker compose", "docker-compose"] = Field(
        "auto", description="the compose client (auto: `docker compose` (v2), else `docker-compose` (v1))"
    )
    skip_parity: bool = Field(False, description=SKIP_PARITY_HELP)

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not v:
            raise ValueError("the compose scheduler needs an image: pass --image REF (see `launcher build`)")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*", v):
            raise ValueError(f"{v!r} is not an image reference (name[:tag], name@sha256:..., or an id)")
        return v

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, v: str) -> str:
        if not re.fullmatch(r"\d+[bkmg]?", v.lower()):
            raise ValueError(f"{v!r} is not a size: use e.g. 8g or 512m")
        return v


# ssh -o options the launcher sets itself (lower-case) and the setting that replaces them.
SSH_MANAGED = {
    "batchmode": "nothing: a launch cannot answer prompts",
    "stricthostkeychecking": "--ssh-host-key-check",
    "connecttimeout": "--ssh-connect-timeout-s",
    "controlmaster": "nothing: the launcher multiplexes connections itself",
    "controlpath": "nothing: the launcher multiplexes connections itself",
    "controlpersist": "nothing: the launcher multiplexes connections itself",
    "serveraliveinterval": "nothing: the keep-alives are how a dead host is noticed",
    "serveralivecountmax": "nothing: the keep-alives are how a dead host is noticed",
    "loglevel": "nothing: the launcher reads ssh's errors to explain them",
    "requesttty": "nothing: a terminal would change how signals and output travel",
}


# Union keeps the discriminator valid; compose options join it.
SchedulerOptions = Annotated[
    Union[LocalOptions, SlurmOptions, SshOptions, ComposeOptions],  # noqa: UP007
    Field(discriminator="kind"),
]


def scheduler_kinds() -> list[str]:
    """The ``kind`` of every scheduler's options model, e.g. ["local", "slurm"]."""
    members = get_args(get_args(SchedulerOptions)[0]) or (get_args(SchedulerOptions)[0],)
    return [get_args(m.model_fields["kind"].annotation)[0] for m in members]
