"""What every scheduler's options model has in common, and how its fields become flags.

A job config says ``scheduler: {kind: slurm, partition: gpu}`` (or just ``scheduler: slurm``); the
``kind`` picks the model, so options of another scheduler are rejected by name. Each scheduler's model
lives in its own folder (``launcher/schedulers/<kind>/options.py``) and is found through the registry
(``launcher.job.registry``), never imported here. An options module imports nothing of the launcher
but this module: the JobSpec loads it while it is itself being imported. Each field is a flag
(``--<field-name>``, unless its ``Flag`` says otherwise).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

if TYPE_CHECKING:  # the JobSpec imports this module (and, through the registry, every options model)
    from launcher.job.spec import JobSpec

# [user@]host: a DNS name, an alias of ~/.ssh/config or an IPv4 address. Never starting with "-" (it
# would be read as an ssh option) and without shell metacharacters. Here, not in the Plan that names
# hosts with it (``NodePlan.named_host``), for the SSH options' checks: the JobSpec loads them while
# it is itself being imported.
HOST_RE = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?[A-Za-z0-9_][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Placeholder:
    """A value only a node knows, written ``{{name}}`` in a Plan (``launcher.job.placeholders``):
    ``resolve`` reads it from the node's environment (raises ValueError naming what is missing);
    ``help`` says where it comes from, for ``launcher render --help``."""

    resolve: Callable[[Mapping[str, str]], str]
    help: str


class SchedulerOptions(BaseModel):
    """Base of every scheduler's options. A subclass sets ``kind`` (a ``Literal`` with that default),
    ``scheduler`` ("module:Class" of its scheduler, imported only when a job runs), its fields, and the
    placeholders its Plans may hold beyond the common ones (``placeholders``: name -> Placeholder)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    scheduler: ClassVar[str]
    placeholders: ClassVar[dict[str, Placeholder]] = {}
    one_machine: ClassVar[bool] = False  # every node on this machine (the loopback reaches them all)

    def check_job(self, job: JobSpec) -> None:
        """Checks of these options against the rest of the job (``JobSpec`` calls it after its own).
        Raises ValueError naming the field and the fix."""

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: Any) -> Any:
        """A renamed field's former name still reads, silently here: job records written before the
        rename hold it. (A config file that uses it gets a deprecation warning from the CLI.)"""
        if not isinstance(data, dict):
            return data
        for old, new in renamed_fields(cls).items():
            if old in data:
                if new in data:
                    raise ValueError(f"{old} is the former name of {new}: keep {new}")
                data = {k: v for k, v in data.items() if k != old} | {new: data[old]}
        return data


@dataclass(frozen=True)
class Flag:
    """In a field's ``Annotated`` type, when its flag is not plain ``--<field-name>``: ``name`` another
    flag (None: no flag), ``group`` the --help section when several schedulers share the flag, ``split``
    a separator that splits one value into a list (``--hosts a,b``; else a list flag repeats),
    ``renamed_from`` the field's former name, still accepted as a deprecated alias (``renamed_fields``)."""

    name: str | None = ""
    _: KW_ONLY
    group: str | None = None
    metavar: str | None = None
    split: str | None = None
    renamed_from: str | None = None

    @classmethod
    def of(cls, info: FieldInfo) -> Flag:
        """The Flag in the annotation of the field ``info`` describes, or the plain one."""
        return next((m for m in info.metadata if isinstance(m, Flag)), cls())


NO_FLAG = Flag(None)


def renamed_fields(model: type[BaseModel]) -> dict[str, str]:
    """Former name -> field of ``model``'s renamed fields (``Flag(renamed_from=...)``)."""
    flags = {name: Flag.of(info) for name, info in model.model_fields.items()}
    return {flag.renamed_from: name for name, flag in flags.items() if flag.renamed_from}


class ParityOptions(SchedulerOptions):
    """Options of a scheduler whose nodes run the version parity probe before training."""

    skip_parity: Annotated[bool, Flag(group="version parity")] = Field(
        False,
        description="train even when the nodes' versions differ (the diff is still printed); by default "
        "the job is refused (ssh) or ends before training (slurm, compose) with exit code 3",
    )


class WarmOptions(SchedulerOptions):
    """Options of a scheduler that can fork its ranks from a warm process (``gptlaunch.warm``)."""

    warm_workers: bool | None = Field(
        None,
        description="fork the ranks from a process that has imported torch, kept per job (and per host "
        "on ssh) across attempts, so that a retry starts them warm (seconds sooner); a rank that starts "
        "before that process is ready starts cold (default: on for local and ssh jobs that may retry: "
        "--retries above 0, a Python program and no --image)",
    )


GATE_GROUP = "health gate"


class GateOptions(SchedulerOptions):
    """Options of a scheduler that can run the health gate (``launcher.preflight.health``) before
    training: ssh before anything starts, slurm in the allocation before the ranks start."""

    health_check: Annotated[bool, Flag(group=GATE_GROUP, renamed_from="preflight")] = Field(
        False,
        description="before training, run the health gate: an all_reduce across the nodes, then between "
        "pairs of nodes, a matmul on every device and (with GPUs) nvidia-smi's health fields; a node it "
        "names (a slow link or device, an unhealthy GPU) refuses the launch with exit code 3 (ssh: nothing "
        "started; slurm: the job ends before training). With --retries, a named node is replaced: by a "
        "spare of the hostfile (ssh) or by a requeue without it (slurm)",
    )
    health_check_warn: Annotated[bool, Flag(group=GATE_GROUP, renamed_from="preflight_warn")] = Field(
        False,
        description="run the health gate as --health-check does, report the nodes it names, and train anyway",
    )
    min_busbw: Annotated[float | None, Flag(metavar="GB/s", group=GATE_GROUP)] = Field(
        None,
        gt=0,
        description="the health gate also names a node whose pairs are all below this bus bandwidth "
        "(default: only below half the median node's best pair)",
    )

    health_compute_s: Annotated[float | None, Flag(metavar="S", group=GATE_GROUP)] = Field(
        None,
        ge=0,
        description="seconds of matmuls per device in the health gate's compute check (default 1; 0: no "
        "compute check, as where the nodes' processes share cores and their rates cannot be compared)",
    )

    @property
    def gate(self) -> bool:
        """Whether the health gate runs (--health-check or --health-check-warn)."""
        return self.health_check or self.health_check_warn

    @model_validator(mode="after")
    def _gate(self) -> GateOptions:
        if self.health_check and self.health_check_warn:
            raise ValueError(
                "--health-check refuses and --health-check-warn launches when a node is named: keep one"
            )
        for name, value in (("--min-busbw", self.min_busbw), ("--health-compute-s", self.health_compute_s)):
            if value is not None and not self.gate:
                raise ValueError(
                    f"{name} is a setting of the health gate: add --health-check (or --health-check-warn)"
                )
        return self


IMAGE_GROUP = "container image"
IMAGE_DESCRIPTION = (
    "the training image every node runs (`launcher build`): NAME[:TAG] or NAME@sha256:…; ssh and slurm "
    "pull it by digest on every node (a tag is resolved to its digest once, at submit) and, without it, "
    "run the hosts' own Python; compose needs it (a local name or id will do there)"
)
_IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")


def check_image_ref(ref: str) -> str:
    """Return ``ref`` unchanged, or raise ValueError when it is not an image reference."""
    if not _IMAGE_REF.fullmatch(ref):
        raise ValueError(f"{ref!r} is not an image reference (name[:tag], name@sha256:..., or an id)")
    return ref


class ContainerOptions(ParityOptions):
    """Options of a scheduler whose nodes may run the training image under a container runtime
    (``runtimes``: the ones it can render)."""

    runtimes: ClassVar[tuple[str, ...]]
    image: Annotated[str | None, Flag(group=IMAGE_GROUP)] = Field(None, description=IMAGE_DESCRIPTION)
    container_runtime: Annotated[
        Literal["auto", "docker", "podman", "pyxis", "apptainer"], Flag(group=IMAGE_GROUP)
    ] = Field(
        "auto",
        description="what runs the image: ssh: docker or podman (auto: podman, else docker, as each host "
        "has); slurm: pyxis (srun --container-image), apptainer or podman (auto: pyxis when srun has it, "
        "else apptainer, else podman)",
    )
    container_mounts: Annotated[list[str], Flag("--container-mount", metavar="DIR", group=IMAGE_GROUP)] = (
        Field(
            default_factory=list,
            description="one more host directory, mounted at the same path in every container (repeatable; "
            "the job record, run dir, workdir and the trainer's data paths are mounted already)",
        )
    )

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("/") and v.endswith(".sif")):  # an Apptainer image file
            check_image_ref(v)
        return v

    @field_validator("container_runtime")
    @classmethod
    def _runtime(cls, v: str) -> str:
        if v != "auto" and v not in cls.runtimes:
            raise ValueError(f"{v!r} cannot run images on this scheduler: use {' or '.join(cls.runtimes)}")
        return v

    @field_validator("container_mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for path in v:
            if not path.startswith("/") or any(c in path for c in ":,\n"):
                raise ValueError(f"{path!r}: give an absolute directory, without ':' or ','")
        return v

    @model_validator(mode="after")
    def _needs_image(self) -> ContainerOptions:
        if self.image is None and (self.container_runtime != "auto" or self.container_mounts):
            raise ValueError("--container-runtime and --container-mount need an image: pass --image REF")
        if self.image is not None and self.image.endswith(".sif") and self.container_runtime != "apptainer":
            raise ValueError(f"{self.image} is an Apptainer image file: pass --container-runtime apptainer")
        return self
