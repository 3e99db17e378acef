"""Options that belong to one scheduler, one model each, joined in ``SchedulerOptions``.

A job config says ``scheduler: {kind: local, gpus: [0, 1]}`` (or just ``scheduler: local``); the
``kind`` picks the model, so options of another scheduler are rejected by name. Adding a scheduler
adds its model to the union here and its module to ``launcher.schedulers.SCHEDULERS``; this module
imports neither (the spec must not import the schedulers, which import the spec).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator


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


# One member today; SLURM, SSH and compose options join it (Union keeps the discriminator valid).
SchedulerOptions = Annotated[Union[LocalOptions], Field(discriminator="kind")]  # noqa: UP007


def scheduler_kinds() -> list[str]:
    """The ``kind`` of every scheduler's options model, e.g. ["local"]."""
    members = get_args(get_args(SchedulerOptions)[0]) or (get_args(SchedulerOptions)[0],)
    return [get_args(m.model_fields["kind"].annotation)[0] for m in members]
