"""What a training program shares with the launcher that runs it, importing no torch at import time.

- ``gptlaunch.runtime``: the public API a script may call (stop requests, the attempt, where to
  checkpoint, progress beats); it does nothing under bare torchrun.
- ``gptlaunch.shim``: ``python -m gptlaunch.shim SCRIPT.py ARGS`` (or ``-m MODULE ARGS``) runs a
  script in this process with the launcher's watch on, and no change to the script.
- ``gptlaunch.contract``: exit codes, environment variables, the stop marker, the heartbeat format.
"""


def package_version() -> str:
    """The installed gptlaunch version. Asked for lazily (``__version__`` of both packages):
    importlib.metadata costs tens of milliseconds that quick commands should not pay."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gptlaunch")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "0.0.0+unknown"
