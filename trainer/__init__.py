"""DDP GPT trainer: reads the standard torchrun environment, knows nothing about the launcher."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gptlaunch")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"
