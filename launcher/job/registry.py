"""The registry of schedulers: the only list of them.

A scheduler is registered as an entry point of the group ``gptlaunch.schedulers`` (as TorchX and
submitit find theirs): its name is the scheduler's kind, its value the options model, whose
``scheduler`` attribute names the scheduler class. This package registers its own in
``pyproject.toml``; a package outside this repository registers more the same way. The JobSpec's
options union, the ``--scheduler`` choices, the generated flags and ``--help`` all come from here.
"""

from __future__ import annotations

import functools
import pkgutil
from importlib.metadata import entry_points

from launcher.job.options import SchedulerOptions

GROUP = "gptlaunch.schedulers"
DEFAULT_KIND = "local"  # the scheduler of a job that names none (user-facing default)


class RegistryError(RuntimeError):
    """A registered scheduler that cannot be loaded; the message names the entry point."""


@functools.cache
def options_models() -> dict[str, type[SchedulerOptions]]:
    """Every registered scheduler's options model by kind: the default first, then by name. Raises
    RegistryError for an entry point that is not an options model of its own kind, or for none at all
    (the package is not installed: ``pip install -e .``)."""
    models: dict[str, type[SchedulerOptions]] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: (e.name != DEFAULT_KIND, e.name)):
        model = ep.load()
        if not (isinstance(model, type) and issubclass(model, SchedulerOptions)):
            raise RegistryError(
                f"entry point {ep.name} = {ep.value} ({GROUP}) is not a SchedulerOptions model"
            )
        if model.model_fields["kind"].default != ep.name:
            raise RegistryError(f"entry point {ep.name} = {ep.value}: the model's kind is not {ep.name!r}")
        models.setdefault(ep.name, model)
    if not models:
        raise RegistryError(f"no scheduler is registered ({GROUP}): install the package (pip install -e .)")
    return models


def scheduler_kinds() -> list[str]:
    """The kind of every registered scheduler, e.g. ["local", "compose", "slurm", "ssh"]."""
    return list(options_models())


def scheduler_class(kind: str) -> type:
    """The scheduler class registered for ``kind`` (imported now). Raises KeyError for an unknown kind."""
    cls: type = pkgutil.resolve_name(options_models()[kind].scheduler)
    return cls
