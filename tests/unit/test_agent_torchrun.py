"""``launcher.agent.torchrun``: torchrun of the agent's own interpreter, with a shorter exit, and the
same exit status and error report as ``python -m torch.distributed.run``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("worker", ["true", "false"])
def test_it_tells_the_agent_of_a_failed_rank_on_the_pipe_and_of_nothing_else(worker: str) -> None:
    told, telling = os.pipe()
    flags = ["--standalone", "--nproc-per-node=1", "--no-python", worker]
    env = os.environ | {FAILED_FD_ENV: str(telling)}
    ran = subprocess.run(
        [sys.executable, "-m", "launcher.agent.torchrun", *flags],
        env=env, pass_fds=(telling,), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    os.close(telling)
    with os.fdopen(told) as pipe:
        said = pipe.read()
    assert ran.returncode == (0 if worker == "true" else 1), ran.stderr
    assert said == ("" if worker == "true" else '{"rank": 0, "exit_code": 1}\n')
