"""Job launcher: JobSpec -> Plan -> scheduler, for torchrun jobs on local, SLURM, SSH and compose."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gptlaunch")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"
