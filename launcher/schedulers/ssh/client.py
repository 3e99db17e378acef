"""Commands on other hosts through the system OpenSSH client (``ssh``).

The OpenSSH client, not a Python SSH library: it honours the user's ``~/.ssh/config`` (aliases, users,
ProxyJump), agents and hardware keys, as a user's own ``ssh`` does. Every connection is
non-interactive (``BatchMode=yes``: a prompt would hang a launch), checks host keys strictly by default
(``StrictHostKeyChecking=yes``; ``accept-new`` only when asked) and is multiplexed over one master
connection per host (``ControlMaster``), so a launch that probes, checks and then starts every host
pays each handshake once.

Host names and options are validated before they reach a command line; remote commands are one
string quoted with ``shlex`` for the remote user's POSIX shell.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from launcher.agent.private import UnsafeDirError, private_dir
from launcher.job.options import HOST_RE

# KEY=VALUE of ``ssh -o`` (e.g. ProxyJump=bastion, Port=2222).
SSH_OPT_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*=[^\x00-\x1f\x7f]+")
SSH_FAILED = 255  # ssh's own exit code for a connection or authentication failure
UNRESOLVED = "Could not resolve hostname"  # what ssh says of a name that does not resolve
# Concurrent ssh clients of one fan-out, by default: 1,000 hosts are probed in 16 waves, with at most
# 64 clients (a few MB and three descriptors each) on this machine. Through one ProxyJump bastion,
# lower it to 10: sshd's MaxStartups (default 10:30:100) drops new unauthenticated connections beyond.
MAX_PARALLEL = 64


class SshError(RuntimeError):
    """A host could not be reached or refused us; the message names the host, the cause and the fix."""


@dataclass(frozen=True)
class Host:
    """One line of a hostfile: a host and its slots (processes it may run; None: not said)."""

    name: str
    slots: int | None = None


def check_host(name: str) -> str:
    """``name`` unchanged if it is a valid ``[user@]host``; raises ValueError otherwise."""
    if not HOST_RE.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a host name: use [user@]host with letters, digits, '.', '_' and '-' "
            "(an alias of ~/.ssh/config works too)"
        )
    return name


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """The hosts of a DeepSpeed/MPI-style hostfile: one ``host [slots=N]`` per line, ``#`` comments
    and blank lines ignored. Raises ValueError naming the line for anything else, or a host listed
    twice."""
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        try:
            check_host(name)
            slots = _slots(rest)
        except ValueError as e:
            raise ValueError(f"{source} line {number}: {e}") from None
        if any(h.name == name for h in hosts):
            raise ValueError(f"{source} line {number}: host {name!r} is listed twice")
        hosts.append(Host(name, slots))
    if not hosts:
        raise ValueError(f"{source} lists no host: write one host per line, e.g. `node1 slots=8`")
    return hosts


def _slots(fields: list[str]) -> int | None:
    if not fields:
        return None
    match = re.fullmatch(r"slots=(\d+)", fields[0])
    if len(fields) > 1 or match is None or int(match.group(1)) < 1:
        raise ValueError(f"expected `slots=N` (N >= 1) after the host, got {' '.join(fields)!r}")
    return int(match.group(1))


@dataclass(frozen=True)
class SshSettings:
    """How every ssh client of a job connects."""

    options: tuple[str, ...] = ()  # extra ``-o KEY=VALUE`` (validated by the spec)
    host_key_check: str = "yes"  # StrictHostKeyChecking: yes, or accept-new when asked
    connect_timeout_s: int = 10
    control_dir: Path | None = None  # where master sockets live (default: control_dir())
    max_parallel: int = MAX_PARALLEL  # concurrent clients of one fan_out

    def argv(self, host: str, command: str, shared: bool = True) -> list[str]:
        """``ssh ... host command``: ``command`` runs in the remote user's shell. Keep-alives notice a
        dead peer within about 3 × 5 s. ``shared``: over the host's master connection (made by the
        first client: ControlMaster), else over a connection of its own, which outlives the master."""
        argv = [
            "ssh",
            "-T",  # no terminal: signals and output as for a pipe
            "-o", "BatchMode=yes",
            "-o", f"StrictHostKeyChecking={self.host_key_check}",
            "-o", f"ConnectTimeout={self.connect_timeout_s}",
            "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip
        if shared:
            argv += [
                "-o", "ControlMaster=auto",
                "-o", f"ControlPath={self.control_dir or control_dir()}/%C-{self._digest()}",
                "-o", "ControlPersist=60",
            ]  # fmt: skip
        else:
            argv += ["-o", "ControlMaster=no", "-o", "ControlPath=none"]
        for option in self.options:
            argv += ["-o", option]
        return [*argv, "--", host, command]

    def _digest(self) -> str:
        """Tells connections made with other options apart: a master opened with another known_hosts
        or key check must not carry this connection (it would skip this one's host key check)."""
        text = "\0".join([self.host_key_check, *self.options])
        return hashlib.sha256(text.encode()).hexdigest()[:8]


def control_dir() -> Path:
    """A private directory for ControlMaster sockets, short enough for a Unix socket path."""
    try:
        return private_dir(Path(tempfile.gettempdir()) / f"gptlaunch-ssh-{os.getuid()}")
    except UnsafeDirError as e:
        raise SshError(f"the ssh connection-sharing directory is unsafe: {e}") from None


@dataclass(frozen=True)
class Result:
    """What one remote command did. ``returncode`` None: it did not finish within the timeout."""

    host: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    raw: bytes = b""  # stdout as it came: a node agent's channel (``launcher.agent.transport``)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def unresolved(self) -> bool:
        """ssh failed because the host's own name does not resolve here (not a ProxyJump's)."""
        name = self.host.rpartition("@")[2].lower()
        return self.returncode == SSH_FAILED and f"{UNRESOLVED} {name}".lower() in self.stderr.lower()

    def error(self) -> str:
        """Why it failed, naming the host and the fix for ssh's own failures."""
        if self.returncode is None:
            return f"{self.host}: no answer within {self.seconds:.0f} s"
        if self.returncode == SSH_FAILED:
            return f"{self.host}: {explain_ssh_failure(self.host, self.stderr)}"
        last = self.stderr.strip().splitlines()[-3:] or self.stdout.strip().splitlines()[-3:]
        return f"{self.host}: exited with code {self.returncode}: {' / '.join(last) or '(no output)'}"


def explain_ssh_failure(host: str, stderr: str) -> str:
    """A readable cause and fix for ssh's exit code 255, from its stderr."""
    text = stderr.strip()
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text:
        return (
            f"its host key has CHANGED since it was recorded in known_hosts (a reinstalled host, or "
            f"someone in the middle): refused. If the change is expected, remove the old key with "
            f"`ssh-keygen -R {host.split('@')[-1]}` and connect once by hand to check and record the new one"
        )
    if "Host key verification failed" in text or "No ED25519 host key is known" in text:
        return (
            "its host key is not in known_hosts (strict host key checking): connect once with "
            f"`ssh {host}` and check the fingerprint, or pass --ssh-host-key-check accept-new to record "
            "keys of new hosts"
        )
    if "Permission denied" in text:
        return "authentication failed (BatchMode: no password prompt): set up a key or an agent"
    if UNRESOLVED in text:
        return "the host name does not resolve here: check the name, /etc/hosts or ~/.ssh/config"
    for cause in ("Connection timed out", "No route to host", "Connection refused", "Network is unreachable"):
        if cause in text:
            return f"unreachable ({cause.lower()}): check that the host is up and runs sshd"
    return f"ssh failed: {text.splitlines()[-1] if text else 'no message'}"


def run(settings: SshSettings, host: str, command: str, timeout_s: float) -> Result:
    """Run ``command`` on ``host`` with an empty stdin and wait at most ``timeout_s`` seconds (then
    kill the client)."""
    start = time.monotonic()
    try:
        proc = subprocess.run(
            settings.argv(host, command),
            input=b"",
            capture_output=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        raw = e.stdout if isinstance(e.stdout, bytes) else b""
        return Result(host, None, _text(raw), "", time.monotonic() - start, raw)
    except FileNotFoundError:
        raise SshError(
            "the OpenSSH client `ssh` is not installed (Debian: apt-get install openssh-client)"
        ) from None
    took = time.monotonic() - start
    return Result(host, proc.returncode, _text(proc.stdout), _text(proc.stderr), took, proc.stdout)


def _text(data: bytes) -> str:
    """A remote command's output as text (universal newlines, as ``text=True`` would give)."""
    return data.decode(errors="replace").replace("\r\n", "\n")


def fan_out(
    settings: SshSettings,
    hosts: Sequence[str],
    command: Callable[[str], str],
    timeout_s: float,
    on_result: Callable[[Result], None] | None = None,
    all_at_once: bool = False,
) -> list[Result]:
    """``command(host)`` on every host, ``settings.max_parallel`` at a time (threads; each waits on
    its own ssh process), in the order of ``hosts``; ``on_result`` sees each result as it comes
    (progress). ``all_at_once``: no cap, for commands that wait for each other (a collective). Wall
    time ≈ the slowest host × the number of waves, not the sum."""

    def one(host: str) -> Result:
        result = run(settings, host, command(host), timeout_s)
        if on_result is not None:
            on_result(result)
        return result

    cap = len(hosts) if all_at_once else settings.max_parallel
    with ThreadPoolExecutor(max_workers=max(1, min(cap, len(hosts)))) as pool:
        return list(pool.map(one, hosts))
