"""``launcher.agent.torchrun``: torchrun of the agent's own interpreter, with a shorter exit, and the
same exit status and error report as ``python -m torch.distributed.run``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from launcher.agent.torchrun import FAILED_FD_ENV, fast_exit

ARGS = ["--nnodes=1", "--nproc-per-node=1", "-m", "trainer.cli", "train"]


def test_only_a_torchrun_of_this_interpreter_is_run_through_the_module() -> None:
    ours = [sys.executable, "-m", "torch.distributed.run", *ARGS]
    assert fast_exit(ours) == [sys.executable, "-m", "launcher.agent.torchrun", *ARGS]
    other = ["/opt/other-venv/bin/python", "-m", "torch.distributed.run", *ARGS]
    assert fast_exit(other) == other  # it may not have gptlaunch installed
    program = [sys.executable, "train.py"]
    assert fast_exit(program) == program


@pytest.mark.parametrize("worker", ["true", "false"])
def test_it_ends_as_torchrun_ends(worker: str) -> None:
    """A worker that succeeds, and one that fails: the same exit code, and the same report of the
    failed worker, as plain torchrun's."""
    flags = ["--standalone", "--nproc-per-node=1", "--no-python", worker]
    ended = {
        module: subprocess.run(
            [sys.executable, "-m", module, *flags], capture_output=True, text=True, timeout=120
        )
        for module in ("torch.distributed.run", "launcher.agent.torchrun")
    }
    plain, ours = ended["torch.distributed.run"], ended["launcher.agent.torchrun"]
    assert ours.returncode == plain.returncode == (0 if worker == "true" else 1), ours.stderr
    failed = "ChildFailedError" in plain.stderr
    assert failed == (worker == "false") and ("ChildFailedError" in ours.stderr) == failed, ours.stderr


def test_the_interpreter_is_looked_up_in_the_path_torchrun_runs_with(tmp_path: Path) -> None:
    other = tmp_path / "python"  # another interpreter first in the node's PATH
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    argv = ["python", "-m", "torch.distributed.run", *ARGS]
    assert fast_exit(argv, path=str(tmp_path)) == argv


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--no-python", "true"], ""),
        (["--no-python", "false"], '{"local_rank": 0, "exit_code": 1}\n'),
        (["--max-restarts=1", "--no-python", "false"], ""),  # restarted in place: no end of the node
    ],
)
def test_it_tells_the_agent_of_a_failed_rank_and_of_nothing_else(flags: list[str], said: str) -> None:
    told, telling = os.pipe()
    ran = subprocess.run(
        [sys.executable, "-m", "launcher.agent.torchrun", "--standalone", "--nproc-per-node=1", *flags],
        env=os.environ | {FAILED_FD_ENV: str(telling)}, pass_fds=(telling,), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    os.close(telling)
    with os.fdopen(told) as pipe:
        assert pipe.read() == said
    assert ran.returncode == (0 if flags[-1] == "true" else 1), ran.stderr


def test_it_tells_before_it_stops_the_nodes_other_ranks(tmp_path: Path) -> None:
    """Local rank 1 fails; local rank 0 takes torchrun's SIGTERM and ends only once the test lets it:
    the word comes while it still runs, and neither the pipe nor its variable reach the ranks."""
    go, pid = tmp_path / "go", tmp_path / "survivor.pid"
    script = (  # rank 1 fails once rank 0 is ready to take the SIGTERM (torchrun's macros: no $$)
        f'if [ "$LOCAL_RANK" = 1 ]; then while [ ! -e {pid} ]; do sleep 0.05; done; exit 3; fi; '
        f'[ -z "${FAILED_FD_ENV}" ] || exit 9; '
        f"trap 'while [ ! -e {go} ]; do sleep 0.05; done; exit 0' TERM; "
        f"echo $BASHPID > {pid}.tmp; mv {pid}.tmp {pid}; while true; do sleep 0.05; done"
    )
    told, telling = os.pipe()
    argv = [sys.executable, "-m", "launcher.agent.torchrun", "--standalone", "--nproc-per-node=2",
            "--no-python", "bash", "-c", script]  # fmt: skip
    env = os.environ | {FAILED_FD_ENV: str(telling)}
    with subprocess.Popen(argv, env=env, pass_fds=(telling,), stderr=subprocess.DEVNULL) as torchrun:
        os.close(telling)
        try:
            with os.fdopen(told) as pipe:
                line = pipe.readline()
                assert json.loads(line) == {"local_rank": 1, "exit_code": 3}
                assert psutil.pid_exists(int(pid.read_text()))  # rank 0 not yet stopped
                go.touch()
                assert pipe.read() == ""
            assert torchrun.wait(120) == 1
        finally:
            go.touch()
            torchrun.kill()
            with contextlib.suppress(OSError, ValueError, psutil.Error):  # torchrun gone: rank 0 too
                psutil.Process(int(pid.read_text())).kill()
