"""The launcher's copy of a share-nothing run dir against real sshd test hosts and real rsync
(``launcher.schedulers.ssh.copies``): what a host saved is pulled here, and pushed to the next
attempt's hosts without taking back what a survivor wrote since; and a retry that cannot have the
newest checkpoint is refused."""

from __future__ import annotations

import os
import time
from pathlib import Path

from launcher.job.logs import wait_terminal
from launcher.job.record import JobRecord
from launcher.job.reports import Saved
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.copies import Copies
from launcher.schedulers.ssh.scheduler import SshScheduler
from tests.integration.conftest import on_host, processes_of, run, runs_module, runs_on, wait_for
from tests.integration.test_ssh_failures import past_step_12_with_a_spare

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


def test_a_retry_without_the_newest_checkpoint_fails_naming_where_it_is(
    hostfile: Path, prepared_data: list[str], private: Path, tmp_path: Path
) -> None:
    """Never a silent restart: this machine's copy of the run dir refuses every write (``chattr +i``,
    as a full disk would), so rank 0's checkpoints exist on its host only. A rank killed after step
    12 ends the job with a message that names the checkpoint, its host and the fix, and no attempt 2
    starts from step 0."""
    run_dir = private / "run"
    run_dir.mkdir()
    run(["chattr", "+i", str(run_dir)], check=True)
    try:
        job = past_step_12_with_a_spare(hostfile, prepared_data, private, tmp_path, retries=1)
        names = [n.host for n in JobRecord(private / "jobs" / job).plan().nodes]
        (holder,) = [h for h in names if (on_host(h, run_dir) / "ckpt-00000010.pt").is_file()]
        (other,) = set(names) - {holder}
        (rank,) = [p for p in processes_of(job) if runs_module(p, "trainer.cli") and runs_on(p, other)]
        rank.kill()
        final = wait_terminal(SshScheduler().state, JobRecord(private / "jobs" / job), 300, poll_s=0.5)
    finally:
        run(["chattr", "-i", str(run_dir)], check=True)
    assert final is not None and final.state == "failed", final
    message = final.message
    assert "attempt 2 of 2 could not be prepared" in message and "does not start over" in message, message
    assert (
        "ckpt-00000010.pt" in message and f"saved on {holder}" in message and "--allow-start-over" in message
    )
    assert f"rsync -a {holder}:{run_dir}/ {run_dir}/" in message, message
    assert not (private / "jobs" / job / "attempts").exists() and not final.attempts  # no attempt 2 ran
    wait_for(lambda: not processes_of(job), 60, "every process of the job to end")
    print(f"\n{message}")
