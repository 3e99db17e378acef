"""What an SSH job needs installed (``launcher.schedulers.ssh.needs``): the host's answer from the real
shell command, and the decision on recorded answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gptlaunch.contract import EXIT_REFUSED, EXIT_USAGE
from launcher.image.runtime import ContainerError, pick
from launcher.job.spec import SpecError
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh import hosts, needs
from launcher.schedulers.ssh.needs import HostNeeds, HostsRefused

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
    with pytest.raises(HostsRefused) as e:
        needs.check({"h1": shared, "h2": lacking, "h3": ALL}, sync=False, say=print)
    assert e.value.exit_code == EXIT_REFUSED
    message = str(e.value)
    assert "share no file system here (h2, h3)" in message and "not installed on h2:" in message
    assert "h1" not in message and "apt-get install rsync" in message
    with pytest.raises(HostsRefused, match=r"--sync needs rsync .* not installed on h1, h2:"):
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


def test_a_host_without_a_container_runtime_is_exit_3_naming_it_and_the_packages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--image``: the pull's answers, as each host's agent gives them (a host that lacks both runtimes
    says ``launcher.image.runtime.pick``'s error last); the registry's refusal stays exit 2."""
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ContainerError) as no_runtime:
        pick("auto")
    said = {"h1": f"error: {no_runtime.value}", "h2": "error: podman pull r/x@sha256:1: connection refused"}

    def fan_out(_settings, names, _command, _timeout, _done=None):  # type: ignore[no-untyped-def]
        return [ssh.Result(host=h, returncode=1, stdout="", stderr=said[h], seconds=0.1) for h in names]

    monkeypatch.setattr(ssh, "fan_out", fan_out)
    settings = ssh.SshSettings(options=(), host_key_check="yes", connect_timeout_s=5, max_parallel=4)
    with pytest.raises(HostsRefused) as e:
        hosts.pull_image(settings, ["h1", "h2"], "python3", "r/x@sha256:1", "auto", print)
    assert e.value.exit_code == EXIT_REFUSED
    assert "h1: no container runtime (podman or docker)" in str(e.value) and "h2" not in str(e.value)
    assert "install podman or docker.io" in str(e.value)
    said["h1"] = said["h2"]
    with pytest.raises(SpecError) as refused:
        hosts.pull_image(settings, ["h1", "h2"], "python3", "r/x@sha256:1", "auto", print)
    assert not isinstance(refused.value, HostsRefused) and "cannot pull the image" in str(refused.value)
