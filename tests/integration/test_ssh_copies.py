"""The launcher's copy of a share-nothing run dir against real sshd test hosts and real rsync
(``launcher.schedulers.ssh.copies``): what a host saved is pulled here, and pushed to the next
attempt's hosts without taking back what a survivor wrote since."""

from __future__ import annotations

import os
import time
from pathlib import Path

from launcher.job.reports import Saved
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.copies import Copies
from tests.integration.conftest import on_host

_CHECKPOINT = "ckpt-00000010.pt"


def _lines(steps: range) -> str:
    return "".join(f'{{"step": {step}}}\n' for step in steps)


def test_a_push_fills_in_what_a_host_lacks_and_keeps_a_survivors_newer_logs(
    hostfile: Path, private: Path
) -> None:
    """gl-h1 saves step 10's checkpoint, which is pulled here; it then logs steps 11 and 12 (a retry
    resumes them from its memory, and does not redo them). The push to the next attempt's hosts leaves
    gl-h1's newer log as it is, gives the spare gl-h3 the checkpoint and the log as of it, and replaces
    gl-h2's log, older than the copy's."""
    run_dir = private / "run"
    survivor, stale, spare = (on_host(h, run_dir) for h in ("gl-h1", "gl-h2", "gl-h3"))
    for path in (survivor, stale):
        path.mkdir(parents=True)
    (survivor / _CHECKPOINT).write_bytes(b"weights" * 100)
    (survivor / "metrics.jsonl").write_text(_lines(range(1, 11)))
    said: list[str] = []
    copies = Copies(ssh.SshSettings(), private / "jobs" / "j", str(run_dir), said.append)
    files = {name: (survivor / name).stat().st_size for name in (_CHECKPOINT, "metrics.jsonl")}
    changed = {_CHECKPOINT: (survivor / _CHECKPOINT).stat().st_mtime_ns}
    copies.on_report(Saved(node=0, host="gl-h1", directory=str(run_dir), files=files, changed=changed))
    copies.settle(timeout_s=120)
    assert copies.missing() is None, said
    assert (run_dir / "metrics.jsonl").read_text() == _lines(range(1, 11)), said

    with (survivor / "metrics.jsonl").open("a") as log:  # steps past the checkpoint, after the pull
        log.write(_lines(range(11, 13)))
    # rsync's --update compares whole seconds: a step's line written in the second of the copy's
    # version would still be replaced (see Copies.push); these came 2 s later.
    later = (run_dir / "metrics.jsonl").stat().st_mtime + 2
    os.utime(survivor / "metrics.jsonl", (later, later))
    (stale / "metrics.jsonl").write_text(_lines(range(1, 4)))  # an earlier run's, older than the copy
    an_hour_ago = time.time() - 3600
    os.utime(stale / "metrics.jsonl", (an_hour_ago, an_hour_ago))
    copies.push(["gl-h1", "gl-h2", "gl-h3"])

    assert (survivor / "metrics.jsonl").read_text() == _lines(range(1, 13))
    for host_dir in (stale, spare):
        assert (host_dir / "metrics.jsonl").read_text() == _lines(range(1, 11)), host_dir
        assert (host_dir / _CHECKPOINT).read_bytes() == b"weights" * 100, host_dir
    assert any("pushed to gl-h1, gl-h2, gl-h3" in line for line in said), said
