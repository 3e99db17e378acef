"""DDP GPT trainer: reads the standard torchrun environment, knows nothing about the launcher."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "__version__":  # looked up on first use (see gptlaunch.package_version)
        from gptlaunch import package_version

        return package_version()
    raise AttributeError(name)
