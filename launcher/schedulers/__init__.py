"""Schedulers: where a job runs. Each is one module behind the protocol in ``base``.

Names map to "module:class" so that listing them imports nothing; their option models live in
``launcher.job.options`` (the same names).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.schedulers.base import Scheduler

SCHEDULERS: dict[str, str] = {
    "local": "launcher.schedulers.local.scheduler:LocalScheduler",
    "slurm": "launcher.schedulers.slurm.scheduler:SlurmScheduler",
    "ssh": "launcher.schedulers.ssh.scheduler:SshScheduler",
    "compose": "launcher.schedulers.compose.scheduler:ComposeScheduler",
}


def get_scheduler(name: str) -> Scheduler:
    """The scheduler called ``name``. Raises KeyError for an unknown name."""
    module, cls = SCHEDULERS[name].split(":")
    scheduler: Scheduler = getattr(importlib.import_module(module), cls)()
    return scheduler
