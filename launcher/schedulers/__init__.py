"""Schedulers: where a job runs. One folder per scheduler (``local/``, ``slurm/``, ``ssh/``,
``compose/``), each with its options model (``options.py``, found through the registry in
``launcher.job.registry``), its scheduler (``scheduler.py``, behind the protocol in ``base``) and what only
it uses. A scheduler folder may import ``launcher.supervisor``, ``launcher.preflight``, ``launcher.image``
and ``launcher.job``, never another scheduler's folder; nothing below this package imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.job.registry import scheduler_class

if TYPE_CHECKING:
    from launcher.schedulers.base import Scheduler


def get_scheduler(name: str) -> Scheduler[Any]:
    """The scheduler registered as ``name``. Raises KeyError for an unknown name."""
    scheduler: Scheduler[Any] = scheduler_class(name)()
    return scheduler
