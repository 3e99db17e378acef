"""The programs an SSH job needs besides Python, checked before any rank starts (``check``; which and
when: docs/schedulers/ssh.md, "Before anything starts"): rsync here and on the hosts it copies to or
from (``launcher.schedulers.ssh.copies``), and py-spy beside the job's Python on every host (optional:
said once). One remote command per host, all at once, over the connection the probes opened, says
where rsync and py-spy are and whether the host reads a token file this machine wrote beside the job
record (then it shares this machine's files and needs no copies).
"""

from __future__ import annotations

import os
import shlex
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gptlaunch.contract import EXIT_REFUSED
from launcher.job.programs import PY_SPY, RSYNC, find, missing
from launcher.job.spec import SpecError
from launcher.schedulers.ssh import client as ssh

CHECK_TIMEOUT_S = 30.0


class HostsRefused(SpecError):
    """Hosts the job cannot run on: one lacks a program the job needs, their versions differ (or GPUs
    are short), or the health gate named them. The message names the hosts and the fix."""

    exit_code = EXIT_REFUSED


@dataclass(frozen=True)
class HostNeeds:
    """What one host answered: whether it has rsync and py-spy, and whether it sees this machine's files."""

    rsync: bool
    py_spy: bool
    shares_files: bool


def command(python: str, token_file: Path) -> str:
    """The shell command that answers for one host: three lines, ``rsync=…``, ``py-spy=…``, ``token=…``."""
    # `[ -x ]` after `command -v`: bash's `command -v` names a file it cannot run when it finds no other
    has = 'p=$(command -v {0}) && [ -x "$p" ] && echo yes'
    beside = f'd=$(dirname "$(command -v {shlex.quote(python)})") && [ -x "$d/py-spy" ] && echo yes'
    return (
        f"echo rsync=$({has.format('rsync')}); "
        f"echo py-spy=$({beside} || {has.format('py-spy')}); "
        f"echo token=$(cat {shlex.quote(str(token_file))} 2>/dev/null)"
    )


def ask(settings: ssh.SshSettings, hosts: list[str], python: str, near: Path) -> dict[str, HostNeeds]:
    """Each host's answer (all at once). ``near``: a directory of this machine beside the job record
    (``near_record``); a token file there, removed after, tells which hosts share it. Raises
    SpecError naming each host that could not be asked."""
    token = uuid.uuid4().hex
    token_file = near / f".gptlaunch-sees-{token}"
    try:
        token_file.write_text(token)
    except OSError as e:
        raise SpecError(
            f"cannot write in {near} ({e.strerror}): pass a writable --jobs-root or --job-dir"
        ) from None
    try:
        results = ssh.fan_out(settings, hosts, lambda _h: command(python, token_file), CHECK_TIMEOUT_S)
    finally:
        token_file.unlink(missing_ok=True)
    failed = [r.error() for r in results if not r.ok]
    if failed:
        raise SpecError("cannot check the programs on every host:\n  " + "\n  ".join(failed))
    return {result.host: answer(result.stdout, token) for result in results}


def answer(stdout: str, token: str) -> HostNeeds:
    """A host's answer: the output of ``command`` there, asked about the token file of ``token``."""
    said = dict(line.partition("=")[::2] for line in stdout.splitlines())
    return HostNeeds(
        rsync=said.get("rsync") == "yes",
        py_spy=said.get("py-spy") == "yes",
        shares_files=said.get("token") == token,
    )


def check(answers: dict[str, HostNeeds], sync: bool, say: Callable[[str], None]) -> None:
    """Refuse the job when a program it needs is missing (see the module docstring); say once which
    hosts lack py-spy. Raises SpecError (this machine) or HostsRefused (hosts)."""
    apart = [h for h, a in answers.items() if not a.shares_files]
    if sync or apart:
        why = (
            "--sync"
            if sync
            else f"the checkpoint copies of hosts that share no file system here ({', '.join(apart)})"
        )
        if find(RSYNC) is None:
            raise SpecError(missing(RSYNC, why))
        # rsync runs on both ends: with --sync every host receives the code, else only the apart ones
        lacking = [h for h, a in answers.items() if not a.rsync and (sync or not a.shares_files)]
        if lacking:
            raise HostsRefused(missing(RSYNC, why, ", ".join(lacking)))
    no_spy = [h for h, a in answers.items() if not a.py_spy]
    if no_spy:
        lost = f"{PY_SPY.optional}; {PY_SPY.install_hint()}"
        say(f"launcher: WARNING: py-spy is not installed on {', '.join(no_spy)}: {lost}")


def near_record(job_dir: Path) -> Path:
    """Where the token file goes: the nearest existing directory above the job record (the jobs root
    once made; nothing is made for a job that may yet be refused)."""
    near = Path(os.path.abspath(job_dir)).parent
    while not near.is_dir() and near != near.parent:
        near = near.parent
    return near
