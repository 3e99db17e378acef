"""The local scheduler's options."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from launcher.job.options import NO_FLAG, WarmOptions


class LocalOptions(WarmOptions):
    """The local scheduler: ``nnodes`` emulated nodes on this machine."""

    scheduler: ClassVar[str] = "launcher.schedulers.local.scheduler:LocalScheduler"
    one_machine: ClassVar[bool] = True
    kind: Literal["local"] = Field(
        "local", description="where the job runs (local: emulated nodes on this machine)"
    )
    gpus: Annotated[list[str] | None, NO_FLAG] = Field(
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
