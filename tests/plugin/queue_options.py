"""The options of a minimal scheduler defined outside ``launcher/`` (``tests/plugin/queue_scheduler.py``):
like every options module, it imports only ``launcher.job.options``, because the JobSpec loads it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from launcher.job.options import SchedulerOptions


class QueueOptions(SchedulerOptions):
    """A made-up batch queue."""

    kind: Literal["queue"] = Field("queue", description="where the job runs (queue: a made-up batch queue)")
    scheduler: ClassVar[str] = "tests.plugin.queue_scheduler:QueueScheduler"
    queue_name: str = Field("default", description="the made-up queue that takes the job")
