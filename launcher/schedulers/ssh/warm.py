"""Spare hosts made ready before they are needed: while a job with ``--retries`` runs, the hostfile's
spares (hosts beyond ``--nodes``) get the job's code (``--sync``) and image (pulled), and are probed,
which starts their interpreter and imports torch once (their page cache then holds them). A retry
that swaps a spare in then finds the copy, the pull and the cold imports done: what is left of its
checks (``SshScheduler.replan``) is incremental, and a spare that cannot take over is named while
the job still runs, not at the failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from launcher.job.spec import SpecError
from launcher.schedulers.ssh.hosts import master_address, probe_hosts, pull_image, ssh_settings
from launcher.schedulers.ssh.options import SshOptions
from launcher.schedulers.ssh.sync import sync


def warm_spares(
    opts: SshOptions,
    spares: list[str],
    job_hosts: list[str],
    python: str,
    workdir: str,
    image: str | None,
    say: Callable[[str], None],
) -> bool:
    """Sync, pull and probe ``spares`` (with ``job_hosts``' first host as the master address they
    route to), one line for the lot; whether they are ready. Errors are said, not raised: the
    retry checks its hosts again whatever happens here."""
    if not spares:
        return False
    started = time.monotonic()
    settings = ssh_settings(opts)
    try:
        sync(opts, spares, workdir, say)
        pulled = None
        if image is not None:
            pulled = pull_image(settings, spares, python, image, opts.container_runtime, say)
        probes = probe_hosts(settings, spares, python, master_address(settings, job_hosts[0]), pulled)
    except (SpecError, OSError) as e:
        say(f"launcher: spare host(s) {', '.join(spares)} not made ready (a retry checks them again): {e}")
        return False
    found = "; ".join(f"{host}: torch {probe.torch}" for host, probe in probes.items())
    say(f"launcher: spare host(s) ready for a retry in {time.monotonic() - started:.1f} s ({found})")
    return True
