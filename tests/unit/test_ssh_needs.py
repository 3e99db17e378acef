"""What an SSH job needs installed (``launcher.schedulers.ssh.needs``): the host's answer from the real
shell command, and the decision on recorded answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gptlaunch.contract import EXIT_REFUSED, EXIT_USAGE
from launcher.job.spec import SpecError
from launcher.schedulers.ssh import needs
from launcher.schedulers.ssh.needs import HostNeeds, MissingProgramError

ALL = HostNeeds(rsync=True, py_spy=True, shares_files=False)


def test_the_command_answers_for_this_machine_as_a_host_would(tmp_path: Path) -> None:
    token_file = tmp_path / ".gptlaunch-sees-x"
    token_file.write_text("tok")
    out = subprocess.run(
        ["sh", "-c", needs.command(sys.executable, token_file)], capture_output=True, text=True
    )
    assert needs.answer(out.stdout, "tok") == HostNeeds(rsync=True, py_spy=True, shares_files=True)
    assert not needs.answer(out.stdout, "another").shares_files  # another job's token file
    bare = subprocess.run(  # a PATH with neither rsync nor py-spy, and no python beside which to look
        ["/bin/sh", "-c", needs.command("python-nowhere", tmp_path / "none")],
        capture_output=True, text=True, env={"PATH": str(tmp_path)},
    )  # fmt: skip
    assert needs.answer(bare.stdout, "tok") == HostNeeds(rsync=False, py_spy=False, shares_files=False)


def test_hosts_that_see_this_machines_files_need_no_rsync_without_sync() -> None:
    shared = HostNeeds(rsync=False, py_spy=True, shares_files=True)
    said: list[str] = []
    needs.check({"h1": shared, "h2": shared}, sync=False, say=said.append)
    assert said == []


def test_a_host_apart_without_rsync_is_named_with_the_package() -> None:
    lacking = HostNeeds(rsync=False, py_spy=True, shares_files=False)
    shared = HostNeeds(rsync=False, py_spy=True, shares_files=True)
    with pytest.raises(MissingProgramError) as e:
        needs.check({"h1": shared, "h2": lacking, "h3": ALL}, sync=False, say=print)
    assert e.value.exit_code == EXIT_REFUSED
    message = str(e.value)
    assert "share no file system here (h2, h3)" in message and "not installed on h2:" in message
    assert "h1" not in message and "apt-get install rsync" in message
    with pytest.raises(MissingProgramError, match=r"--sync needs rsync .* not installed on h1, h2:"):
        needs.check({"h1": shared, "h2": lacking, "h3": ALL}, sync=True, say=print)  # every host receives


def test_without_rsync_here_sync_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing installed; nothing beside this Python either
    with pytest.raises(SpecError) as e:
        needs.check({"h1": ALL}, sync=True, say=print)
    assert getattr(e.value, "exit_code", EXIT_USAGE) == EXIT_USAGE  # how the CLI reads it: exit 2
    assert "--sync needs rsync" in str(e.value) and "not installed on this machine" in str(e.value)


def test_hosts_without_py_spy_are_said_once_with_what_is_lost() -> None:
    no_spy = HostNeeds(rsync=True, py_spy=False, shares_files=True)
    said: list[str] = []
    needs.check({"h1": no_spy, "h2": no_spy, "h3": ALL}, sync=False, say=said.append)
    assert len(said) == 1 and "py-spy is not installed on h1, h2:" in said[0]
    assert "without the ranks' Python stacks" in said[0] and "pip install py-spy" in said[0]


def test_the_token_goes_beside_the_record_in_a_directory_that_exists(tmp_path: Path) -> None:
    assert needs.near_record(tmp_path / "jobs" / "job-1") == tmp_path  # jobs/ is not made yet
    (tmp_path / "jobs").mkdir()
    assert needs.near_record(tmp_path / "jobs" / "job-1") == tmp_path / "jobs"
