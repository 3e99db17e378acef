"""The compose scheduler's options."""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from launcher.job.options import (
    IMAGE_DESCRIPTION,
    IMAGE_GROUP,
    NO_FLAG,
    JobView,
    ParityOptions,
    check_gpus_once,
    check_image_ref,
    flag,
)


class ComposeOptions(ParityOptions):
    """The compose scheduler: one container of the training image per node, on a private network of
    one Docker engine (docker compose v2 or docker-compose v1)."""

    scheduler: ClassVar[str] = "launcher.schedulers.compose.scheduler:ComposeScheduler"
    kind: Literal["compose"] = Field(
        "compose", description="where the job runs (compose: one container per node, docker compose)"
    )
    image: str = Field(
        "",
        validate_default=True,
        description=IMAGE_DESCRIPTION,
        json_schema_extra=flag(group=IMAGE_GROUP),
    )
    shm_size: str = Field(
        "8g",
        description="shared memory of each container (Docker's 64m default breaks NCCL)",
        json_schema_extra=flag(group=IMAGE_GROUP),
    )
    gpus: bool | None = Field(
        None,
        description="reserve --gpus-per-node GPUs for each container (default: when the engine has the "
        "nvidia runtime)",
        json_schema_extra=NO_FLAG,
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

    def check_job(self, job: JobView) -> None:
        check_gpus_once(self.gpus, job)
