"""JobSpec: what to run and where, validated once at the edge.

Every field is scheduler-neutral except ``scheduler``, which holds the chosen scheduler's own options
(``launcher.job.options``). It stays what the user asked for: what a scheduler finds at submit (a free
port, hosts, GPU slices) is recorded in the Plan, not here. Unknown fields are rejected, and every
string that could reach a shell or an environment is checked for control characters (``check_text``).
"""

from __future__ import annotations

import os
import re
import sys
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from launcher.job.hang import HangSpec
from launcher.job.options import SchedulerOptions
from launcher.job.registry import DEFAULT_KIND, options_models, scheduler_kinds

if TYPE_CHECKING:
    SchedulerOptionsUnion = SchedulerOptions
else:  # the registered models, discriminated by ``kind``: built when this module is imported
    SchedulerOptionsUnion = Annotated[Union[tuple(options_models().values())], Field(discriminator="kind")]  # noqa: UP007

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Control (Cc), format (Cf: bidi overrides, zero-width) and line/paragraph separators (Zl, Zp): they
# split lines or disguise what a printed command does.
_UNSAFE_CATEGORIES = {"Cc", "Cf", "Zl", "Zp"}
# Set by the launcher or torchrun on every process; a user value would break rendezvous or tracking.
RESERVED_ENV = re.compile(
    r"^(GPTLAUNCH_.*|TORCHELASTIC_.*|RANK|LOCAL_RANK|GROUP_RANK|ROLE_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE"
    r"|MASTER_ADDR|MASTER_PORT)$"
)


DEFAULT_SECRETS = ("HF_TOKEN", "WANDB_API_KEY")


_OptionsT = TypeVar("_OptionsT", bound=SchedulerOptions)
_T = TypeVar("_T")


class SpecError(ValueError):
    """A job that cannot run as specified; the message names the field and the fix."""


def check_text(value: str, what: str) -> str:
    """Return ``value`` unchanged, or raise ValueError if it holds a control or format character
    (newline, tab, NUL, escape, bidi override, ...), which no quoting makes safe everywhere."""
    for ch in value:
        if unicodedata.category(ch) in _UNSAFE_CATEGORIES:
            raise ValueError(f"{what} contains the control character {ch!r}: remove it")
    return value


def _checked(what: str) -> AfterValidator:
    """``check_text`` as a field's validator: of its value (a str or a Path; None passes), or of each
    item of a list; ``what`` names it in the error, with ``{!r}`` for the value."""

    def check(v: _T) -> _T:
        for item in v if isinstance(v, list) else [] if v is None else [v]:
            check_text(str(item), what.format(item))
        return v

    return AfterValidator(check)


_ProgramArg = _checked("program argument {!r}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Program(_Strict):
    """The user's program, in one of torchrun's forms: a Python script (``SCRIPT.py ARGS``), a module
    (``-m MODULE ARGS``) or a program that is not Python (``--no-python PROGRAM ARGS``). Python ones run
    through ``gptlaunch.shim``, which watches them with no change to their code."""

    kind: Literal["script", "module", "no_python"] = Field(description="script, module or no_python")
    target: Annotated[str, _ProgramArg] = Field(
        min_length=1, description="the script's path, the module's name or the program"
    )
    args: Annotated[list[str], _ProgramArg] = Field(
        default_factory=list, description="the program's arguments"
    )
    resume_args: Annotated[list[str], _ProgramArg] = Field(
        default_factory=list,
        description="added to args from the job's second attempt on (--init_from=resume)",
    )

    def argv(self) -> list[str]:
        """What follows torchrun's own flags: ``-m gptlaunch.shim [-m] TARGET ARGS``, or ``--no-python
        PROGRAM ARGS`` (no shim: it is not Python)."""
        if self.kind == "no_python":
            return ["--no-python", self.target, *self.args]
        return ["-m", "gptlaunch.shim", *(["-m"] if self.kind == "module" else []), self.target, *self.args]


def split_program(tail: list[str]) -> tuple[Program | None, list[str]]:
    """What follows ``--`` on the command line: (the user's program, None for the built-in trainer; the
    trainer's arguments). A program is named first, as torchrun takes it: ``SCRIPT.py ...`` (anything
    not starting with ``-``), ``-m MODULE ...`` or ``--no-python PROGRAM ...``; trainer arguments are
    flags. Raises SpecError for ``-m`` or ``--no-python`` with nothing after it. The program is
    validated with the rest of the spec (``JobSpec``), whose errors name the field."""
    if not tail or (tail[0].startswith("-") and tail[0] not in ("-m", "--no-python")):
        return None, tail
    if tail[0] in ("-m", "--no-python"):
        if len(tail) < 2:
            raise SpecError(f"`-- {tail[0]}` needs a name after it, e.g. `-- {tail[0]} NAME ARGS`")
        kind: Literal["module", "no_python"] = "module" if tail[0] == "-m" else "no_python"
        return Program.model_construct(kind=kind, target=tail[1], args=tail[2:]), []
    return Program.model_construct(kind="script", target=tail[0], args=tail[1:]), []


class RendezvousSpec(_Strict):
    """How the torchrun agents find each other (torchrun's --rdzv-* flags)."""

    backend: Literal["auto", "c10d", "static"] = Field(
        "auto",
        description="static: node k is node rank k, and node 0's agent holds the TCP store; c10d: the "
        "agents meet at a TCP store on the endpoint and agree on node ranks; auto: static where the "
        "launcher knows every node's rank and node 0 holds the store (local, ssh, compose, without "
        "--rdzv-endpoint), else c10d",
    )
    endpoint: str | None = Field(
        None, description="host of the rendezvous store (default: the first node; 127.0.0.1 when local)"
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="rendezvous port (default: a free port of the first host, local or ssh; derived "
        "from the job id on SLURM)",
    )
    id: str | None = Field(None, description="rendezvous id (default: the job id, unique per job)")
    join_timeout_s: int = Field(600, ge=1, description="seconds to wait for all nodes to join")
    last_call_timeout_s: int = Field(30, ge=0, description="seconds to wait for late joiners")
    max_restarts: int = Field(0, ge=0, description="torchrun restarts of the worker group on failure")

    @field_validator("endpoint", "id")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        if v is not None:
            check_text(v, "value")
            if not v or any(c.isspace() for c in v):
                raise ValueError("must be non-empty and contain no spaces")
        return v


class NetworkSpec(_Strict):
    """Network settings for the collectives, passed to every node as environment variables."""

    nccl_socket_ifname: str | None = Field(None, description="NCCL_SOCKET_IFNAME, e.g. eth0 or ^docker,lo")
    gloo_socket_ifname: str | None = Field(None, description="GLOO_SOCKET_IFNAME, e.g. eth0")
    nccl_ib_disable: bool | None = Field(
        None,
        description="NCCL_IB_DISABLE (set only when given): true makes NCCL use TCP sockets instead of "
        "InfiniBand, and so also disables RoCE",
    )
    nccl_debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(None, description="NCCL_DEBUG")
    debug: bool = Field(
        False,
        description="NCCL_DEBUG=INFO (unless nccl_debug is set) and TORCH_DISTRIBUTED_DEBUG=DETAIL: "
        "which interfaces and transports NCCL picks, and collective mismatches, in the node logs",
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")

    @field_validator("nccl_socket_ifname", "gloo_socket_ifname")
    @classmethod
    def _ifname(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[\^=]?[A-Za-z0-9_.:@,^-]+", v):
            raise ValueError("an interface name like eth0, a list like eth0,eth1 or an exclusion like ^lo")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
            if RESERVED_ENV.match(key):
                raise ValueError(f"{key} is set by the launcher or torchrun on every process: remove it")
            check_text(value, f"the value of {key}")
        return v

    def as_env(self) -> dict[str, str]:
        """The environment variables these settings stand for, extra ``env`` last (it wins)."""
        out: dict[str, str] = {}
        if self.nccl_socket_ifname:
            out["NCCL_SOCKET_IFNAME"] = self.nccl_socket_ifname
        if self.gloo_socket_ifname:
            out["GLOO_SOCKET_IFNAME"] = self.gloo_socket_ifname
        if self.nccl_ib_disable is not None:
            out["NCCL_IB_DISABLE"] = "1" if self.nccl_ib_disable else "0"
        if self.nccl_debug or self.debug:
            out["NCCL_DEBUG"] = self.nccl_debug or "INFO"
        if self.debug:
            out["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        return out | self.env


class JobSpec(_Strict):
    """One training job: how many nodes and processes, where, and the trainer's arguments."""

    name: str = Field("gpt", description="job name, the prefix of the job id ([A-Za-z0-9._-], up to 64)")
    scheduler: SchedulerOptionsUnion = Field(
        default_factory=lambda: options_models()[DEFAULT_KIND].model_validate({}),
        description="where the job runs, and that scheduler's options (kind: one of the registered "
        "schedulers, see --scheduler)",
    )
    nnodes: int = Field(1, ge=1, le=4096, description="number of nodes, nnodes")
    nproc_per_node: int = Field(
        1,
        ge=1,
        le=256,
        description="processes per node: one per GPU; on a machine without GPUs, CPU processes",
    )
    rendezvous: RendezvousSpec = RendezvousSpec()  # frozen: safe to share as a default
    network: NetworkSpec = NetworkSpec()
    python: Annotated[str, _checked("python")] = Field(
        sys.executable,
        description="the Python interpreter that runs torchrun on each node (default: the one that runs "
        "the launcher)",
    )
    workdir: Annotated[Path | None, _checked("path")] = Field(
        None, description="working directory of every node's processes (default: the current directory)"
    )
    job_dir: Annotated[Path | None, _checked("path")] = Field(
        None, description="job record directory, new or empty (default: JOBS_ROOT/JOB_ID)"
    )
    omp_num_threads: int | None = Field(
        None,
        ge=1,
        description="OMP_NUM_THREADS per process (default: OMP_NUM_THREADS from env, else cores "
        "shared out evenly when local)",
    )
    grace_period_s: float = Field(
        45.0, gt=0, description="seconds between SIGTERM (checkpoint and exit) and SIGKILL on cancel"
    )
    hang: HangSpec = Field(default_factory=HangSpec, description="the hang watchdog's budgets")
    retries: int = Field(
        0,
        ge=0,
        le=100,
        description="attempts after the first when the job fails for a reason that is not the user's (a "
        "rank killed by a signal, a lost node or connection, a hang, a peer's NCCL/gloo error, a node "
        "the health gate named): each starts from the last checkpoint (at once, unless the failure "
        "repeats with no new step: then after a backoff), away from the failed node (SSH: a spare host of "
        "the hostfile; SLURM: the node excluded; local, compose: the same nodes). Not retried: invalid "
        "input (a rank that exits 2 too), a parity refusal, a stop on request, a non-finite loss, a run "
        "dir whose file system is full, the same error at the same step twice. (torchrun's "
        "--max-restarts instead restarts the ranks in place, on the same nodes.)",
    )
    retry_backoff_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="seconds before a retry whose failure repeats, with no step past the earlier attempts', "
        "doubled for each further repeat in a row; a failure after new steps (the first, too) is retried "
        "at once",
    )
    allow_start_over: bool = Field(
        False,
        description="a retry may go on from an older checkpoint, or from step 0, when the newest one is "
        "out of reach (SSH hosts that share no file system, SLURM nodes with a node-local run dir: it was "
        "on a lost host, not yet copied). Without it, such a retry fails and names where that checkpoint is",
    )
    secret_env: list[str] = Field(
        default_factory=lambda: list(DEFAULT_SECRETS),
        description="environment variables that are secret (always also HF_TOKEN, WANDB_API_KEY): never "
        "written (not in env, scripts, records or logs); the job gets them from the submitting shell",
    )
    sweep_id: str | None = Field(
        None,
        description="the sweep this job is a run of (`launcher submit --sweep` sets it): its ranks get it",
    )
    trainer_args: Annotated[list[str], _checked("trainer argument {!r}")] = Field(
        default_factory=list, description="arguments of `trainer train`"
    )
    program: Program | None = Field(None, description="the user's program (None: the built-in trainer)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("use 1-64 characters from A-Z a-z 0-9 . _ - starting with a letter or digit")
        return v

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler_kind(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = {"kind": v}
        if isinstance(v, dict):
            v = {"kind": DEFAULT_KIND} | v
            if v["kind"] not in (None, *scheduler_kinds()):
                raise ValueError(
                    f"scheduler {v['kind']!r} is not available; choose one of: {', '.join(scheduler_kinds())}"
                )
        return v

    @field_validator("secret_env")
    @classmethod
    def _secrets(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        return v

    @model_validator(mode="after")
    def _fields_agree(self) -> JobSpec:
        self.scheduler.check_job(self)
        # The GPUs of a scheduler's ``gpus`` option (local, compose, slurm) and CUDA_VISIBLE_DEVICES:
        # one setting, one source.
        if getattr(self.scheduler, "gpus", None) is not None and "CUDA_VISIBLE_DEVICES" in self.network.env:
            raise ValueError(
                "the GPUs are given twice (scheduler.gpus and CUDA_VISIBLE_DEVICES in env / --env): keep one"
            )
        for flag, name in (
            ("--gloo-socket-ifname", self.network.gloo_socket_ifname),
            ("--nccl-socket-ifname", self.network.nccl_socket_ifname),
        ):
            if name in ("lo", "lo0") and self.nnodes > 1 and not self.scheduler.one_machine:
                raise ValueError(
                    f"{flag} {name}: the loopback interface reaches no other machine, and the {self.nnodes} "
                    f"nodes of a {self.scheduler.kind} job are on different ones; name the interface "
                    "that routes between them (e.g. eth0), or leave it unset"
                )
        for name in {*self.secret_env, *DEFAULT_SECRETS}:
            if name in self.network.env:
                raise ValueError(
                    f"{name} is secret (secret_env): do not pass it with --env, where it would be "
                    f"written to the job record; export it in the shell that submits (export {name}=...), "
                    "the job gets it from there at run time"
                )
        if self.program is not None and self.trainer_args:
            raise ValueError(
                "both a program and trainer_args are given: trainer_args are the built-in trainer's; "
                "put your program's arguments after its name"
            )
        if self.omp_num_threads is not None and "OMP_NUM_THREADS" in self.network.env:
            raise ValueError(
                "OMP_NUM_THREADS is set twice (omp_num_threads / --omp-num-threads and env / --env): keep one"
            )
        return self

    def options(self, model: type[_OptionsT]) -> _OptionsT:
        """The scheduler's options as ``model``, for that scheduler's own code. Raises TypeError (a
        bug, not a user mistake) when the job is another scheduler's."""
        if not isinstance(self.scheduler, model):
            raise TypeError(f"a {self.scheduler.kind} job, not a {model.__name__} one")
        return self.scheduler

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def secrets_here(self) -> dict[str, str]:
        """The secret variables (``secret_env`` and DEFAULT_SECRETS) set in this process's environment:
        what a scheduler hands to the nodes at run time, never on a command line or in a file."""
        names = {*self.secret_env, *DEFAULT_SECRETS}
        return {name: os.environ[name] for name in sorted(names) if name in os.environ}
