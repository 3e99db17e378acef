"""``--sync DIR``: the user's code, copied to the job's workdir on every host before launch, for hosts
that share no file system with this machine.

rsync over the job's own ssh settings (``rsync -e 'ssh -o ...'``: the same host key check, options,
ProxyJump and shared connection as every other command), ``SshSettings.max_parallel`` hosts at a
time, one line per host as each finishes. Nothing is deleted on the hosts (``--delete`` would remove
what a run wrote beside the code, such as its checkpoints); ``--mkpath`` creates the workdir.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from launcher.job.spec import SpecError
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.hosts import ssh_settings
from launcher.schedulers.ssh.options import SshOptions

SYNC_TIMEOUT_S = 1800.0  # one host's copy (a large checkout through a slow link)
_STAT = re.compile(r"^(Number of regular files transferred|Total transferred file size): ([\d,]+)", re.M)


def rsync_argv(settings: ssh.SshSettings, host: str, source: str, dest: str) -> list[str]:
    """``rsync -a --mkpath --stats -e 'ssh ...' SOURCE/ DEST/``: SOURCE's content into DEST, one of
    them ``HOST:PATH``."""
    remote_shell = shlex.join(settings.argv(host, "")[:-3])  # the ssh client, less "-- host command"
    return ["rsync", "-a", "--mkpath", "--stats", "-e", remote_shell, f"{source}/", f"{dest}/"]


def transferred(stdout: str) -> tuple[int, int]:
    """(files, bytes) rsync's ``--stats`` says it transferred."""
    stats = {k: int(v.replace(",", "")) for k, v in _STAT.findall(stdout)}
    return stats.get("Number of regular files transferred", 0), stats.get("Total transferred file size", 0)


def sync(opts: SshOptions, hosts: list[str], workdir: str, say: Callable[[str], None]) -> None:
    """Copy ``opts.sync`` into ``workdir`` on every host (see the module docstring); nothing without
    ``--sync``. Raises SpecError naming every host whose copy failed, with rsync's error."""
    source, settings = opts.sync, ssh_settings(opts)
    if source is None or not hosts:
        return
    if not source.is_dir():
        raise SpecError(f"sync (--sync) {source} is not a directory here: name the directory of your code")

    def one(host: str) -> str | None:
        started = time.monotonic()
        argv = rsync_argv(settings, host, str(source.absolute()), f"{host}:{workdir}")
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=SYNC_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{host}: {e}"
        if done.returncode != 0:
            return f"{host}: rsync exited {done.returncode}: {done.stderr.strip()[-500:]}"
        files, size = transferred(done.stdout)
        say(
            f"launcher: sync: {host}: {files} file(s), {size / 1e6:.1f} MB into {workdir} "
            f"in {time.monotonic() - started:.1f} s"
        )
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(settings.max_parallel, len(hosts)))) as pool:
        failed = [e for e in pool.map(one, hosts) if e is not None]
    if failed:
        raise SpecError("--sync could not copy the code to every host:\n  " + "\n  ".join(failed))
