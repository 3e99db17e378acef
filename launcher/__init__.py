"""Job launcher: JobSpec -> Plan -> scheduler, for torchrun jobs on local, SLURM, SSH and compose."""

from typing import Any


def __getattr__(name: str) -> Any:
    # ``__version__`` is looked up on first use: importlib.metadata costs tens of milliseconds, which
    # every quick command (``launcher status``, the node entry point) would otherwise pay.
    if name != "__version__":
        raise AttributeError(name)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gptlaunch")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "0.0.0+unknown"
