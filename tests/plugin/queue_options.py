"""The options of a minimal scheduler defined outside ``launcher/`` (``tests/plugin/queue_scheduler.py``):
like every options module, it imports only ``launcher.job.options``, because the JobSpec loads it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import Field

from launcher.job.options import Placeholder, SchedulerOptions


def _queue_slot(env: Mapping[str, str]) -> str:
    if "QUEUE_SLOT" not in env:
        raise ValueError("QUEUE_SLOT is not set on this node")
    return env["QUEUE_SLOT"]


class QueueOptions(SchedulerOptions):
    """A made-up batch queue."""

    kind: Literal["queue"] = Field("queue", description="where the job runs (queue: a made-up batch queue)")
    scheduler: ClassVar[str] = "tests.plugin.queue_scheduler:QueueScheduler"
    # A placeholder of its own, filled in on the node as the common ones are.
    placeholders: ClassVar[dict[str, Placeholder]] = {"queue_slot": Placeholder(_queue_slot, "QUEUE_SLOT")}
    queue_name: str = Field("default", description="the made-up queue that takes the job")
