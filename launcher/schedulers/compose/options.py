"""The compose scheduler's options."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from launcher.job.options import (
    IMAGE_DESCRIPTION,
    IMAGE_GROUP,
    NO_FLAG,
    Flag,
    ParityOptions,
    check_image_ref,
)


class ComposeOptions(ParityOptions):
    """The compose scheduler: one container of the training image per node, on a private network of
    one Docker engine (docker compose v2 or docker-compose v1)."""

    scheduler: ClassVar[str] = "launcher.schedulers.compose.scheduler:ComposeScheduler"
    kind: Literal["compose"] = Field(
        "compose", description="where the job runs (compose: one container per node, docker compose)"
    )
    image: Annotated[str, Flag(group=IMAGE_GROUP)] = Field(
        "",
        validate_default=True,
        description=IMAGE_DESCRIPTION,
    )
    shm_size: Annotated[str, Flag(group=IMAGE_GROUP)] = Field(
        "8g",
        description="shared memory of each container (Docker's 64m default breaks NCCL)",
    )
    gpus: Annotated[bool | None, NO_FLAG] = Field(
        None,
        description="reserve --gpus-per-node GPUs for each container (default: when the engine has the "
        "nvidia runtime)",
    )
    compose_command: Literal["auto", "docker compose", "docker-compose"] = Field(
        "auto", description="the compose client (auto: `docker compose` (v2), else `docker-compose` (v1))"
    )

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not v:
            raise ValueError("the compose scheduler needs an image: pass --image REF (see `launcher build`)")
        return check_image_ref(v)

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, v: str) -> str:
        if not re.fullmatch(r"\d+[bkmg]?", v.lower()):
            raise ValueError(f"{v!r} is not a size: use e.g. 8g or 512m")
        return v
