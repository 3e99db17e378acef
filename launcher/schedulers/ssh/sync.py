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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from launcher.job.spec import SpecError
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.hosts import ssh_settings
from launcher.schedulers.ssh.options import SshOptions

SYNC_TIMEOUT_S = 1800.0  # one host's copy (a large checkout, a checkpoint, through a slow link)
_STAT = re.compile(r"^(Number of regular files transferred|Total transferred file size): ([\d,]+)", re.M)


def rsync_argv(
    settings: ssh.SshSettings, host: str, source: str, dest: str, extra: Sequence[str] = ()
) -> list[str]:
    """``rsync -a --mkpath --stats EXTRA -e 'ssh ...' SOURCE/ DEST/``: SOURCE's content into DEST, one
    of them ``HOST:PATH``."""
    remote_shell = shlex.join(settings.argv(host, "")[:-3])  # the ssh client, less "-- host command"
    return ["rsync", "-a", "--mkpath", "--stats", *extra, "-e", remote_shell, f"{source}/", f"{dest}/"]


def to_hosts(
    settings: ssh.SshSettings,
    hosts: list[str],
    source: str,
    dest: str,
    extra: Sequence[str] = (),
    done: Callable[[str, str, float], None] = lambda _host, _stdout, _s: None,
) -> list[str]:
    """rsync ``source`` into ``dest`` on every host, ``settings.max_parallel`` at a time; ``done(host,
    rsync's stdout, seconds)`` as each succeeds. The failures, as ``host: error``."""

    def one(host: str) -> str | None:
        started = time.monotonic()
        argv = rsync_argv(settings, host, source, f"{host}:{dest}", extra)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=SYNC_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{host}: {e}"
        if proc.returncode != 0:
            return f"{host}: rsync exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
        done(host, proc.stdout, time.monotonic() - started)
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(settings.max_parallel, len(hosts)))) as pool:
        return [e for e in pool.map(one, hosts) if e is not None]


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

    def done(host: str, stdout: str, seconds: float) -> None:
        files, size = transferred(stdout)
        say(f"launcher: sync: {host}: {files} file(s), {size / 1e6:.1f} MB into {workdir} in {seconds:.1f} s")

    failed = to_hosts(settings, hosts, str(source.absolute()), workdir, done=done)
    if failed:
        raise SpecError("--sync could not copy the code to every host:\n  " + "\n  ".join(failed))
