"""What every scheduler's options model has in common, and how its fields become flags.

A job config says ``scheduler: {kind: slurm, partition: gpu}`` (or just ``scheduler: slurm``); the
``kind`` picks the model, so options of another scheduler are rejected by name. Each scheduler's model
lives in its own folder (``launcher/schedulers/<kind>/options.py``) and is found through the registry
(``launcher.job.registry``), never imported here. An options module imports nothing of the launcher
but this module: the JobSpec loads it while it is itself being imported.

Flags are generated from the fields: ``--<field-name>`` by default; ``flag(...)`` in a field's
``json_schema_extra`` renames it, groups it or leaves it without a flag.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field


class JobView(Protocol):
    """The scheduler-neutral part of a JobSpec that an options model may check itself against."""

    @property
    def grace_period_s(self) -> float: ...

    @property
    def env(self) -> dict[str, str]: ...


class SchedulerOptions(BaseModel):
    """Base of every scheduler's options. A subclass sets ``kind`` (a ``Literal`` with that default),
    ``scheduler`` ("module:Class" of its scheduler, imported only when a job runs) and its fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    scheduler: ClassVar[str]

    def check_job(self, job: JobView) -> None:
        """Checks of these options against the rest of the job (``JobSpec`` calls it after its own).
        Raises ValueError naming the field and the fix."""


def check_gpus_once(gpus: object, job: JobView) -> None:
    """Raises ValueError when a scheduler's ``gpus`` option and CUDA_VISIBLE_DEVICES in --env are both
    given: one setting, one source."""
    if gpus is not None and "CUDA_VISIBLE_DEVICES" in job.env:
        raise ValueError(
            "the GPUs are given twice (scheduler.gpus and CUDA_VISIBLE_DEVICES in env / --env): keep one"
        )


def flag(
    name: str | None = "", *, group: str | None = None, metavar: str | None = None, split: str | None = None
) -> dict[str, Any]:
    """The ``json_schema_extra`` of a field whose flag is not plain ``--<field-name>``: ``name`` another
    flag (None: no flag), ``group`` the --help section when several schedulers share the flag, ``split``
    a separator that splits one value into a list (``--hosts a,b``; else a list flag repeats)."""
    return {"flag": name, "flag_group": group, "flag_metavar": metavar, "flag_split": split}


NO_FLAG = flag(None)


class ParityOptions(SchedulerOptions):
    """Options of a scheduler whose nodes run the version parity probe before training."""

    skip_parity: bool = Field(
        False,
        description="train even when the nodes' versions differ (the diff is still printed); by default "
        "the job is refused (ssh) or ends before training (slurm, compose) with exit code 3",
        json_schema_extra=flag(group="version parity"),
    )
