"""Late-bound values: what only a node knows at run time, written as ``{{name}}`` in a Plan.

A SLURM allocation's first host, a node's index within the job, the network interface that reaches
the rendezvous host: none is known where the Plan is rendered. The Plan holds the placeholder instead
of a guess, so every value in it stays a literal that golden tests pin and shell quoting covers; the
node-side entry point (``python -m launcher.job.node -- ARGV...``) replaces them just before it execs ARGV.

The common placeholders are ``COMMON`` (``{{ifname}}``: for NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME;
``help_text()`` is what `launcher render --help` shows); a scheduler adds its own through its options
model (``SchedulerOptions.placeholders``): SLURM's ``{{slurm_job_id}}`` and ``{{rdzv_port}}`` are in
``launcher.schedulers.slurm.options``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Mapping

from gptlaunch.contract import FIRST_HOST_ENV, NODE_RANK_ENV
from launcher.job.options import Placeholder
from launcher.job.registry import options_models

PATTERN = re.compile(r"\{\{([a-z_]+)\}\}")


class PlaceholderError(ValueError):
    """A placeholder that this node cannot fill in; the message says which variable is missing."""


def _first_env(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if env.get(name):
            return env[name]
    raise PlaceholderError(f"none of {', '.join(names)} is set on this node")


def _node_rank(env: Mapping[str, str]) -> str:
    return _first_env(env, "SLURM_NODEID", NODE_RANK_ENV)


def _first_host(env: Mapping[str, str]) -> str:
    # FIRST_HOST_ENV first (a SLURM batch script sets it): in an image, scontrol may be missing.
    if env.get("SLURM_JOB_NODELIST") and not env.get(FIRST_HOST_ENV):
        return _run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]]).split()[0]
    return _first_env(env, FIRST_HOST_ENV)


def _ifname(env: Mapping[str, str]) -> str:
    host = _first_host(env)
    try:
        address = socket.gethostbyname(host)
    except OSError as e:
        raise PlaceholderError(f"the first host {host!r} does not resolve on this node: {e}") from None
    fields = _run(["ip", "-o", "route", "get", address]).split()
    if "dev" not in fields:
        raise PlaceholderError(f"`ip route get {address}` names no interface")
    return fields[fields.index("dev") + 1]


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise PlaceholderError(f"`{' '.join(argv)}` failed: {e}") from None


COMMON = {
    "node_rank": Placeholder(_node_rank, "SLURM_NODEID, else GPTLAUNCH_NODE_RANK"),
    "first_host": Placeholder(_first_host, "GPTLAUNCH_FIRST_HOST, else the first host of SLURM_JOB_NODELIST"),
    "ifname": Placeholder(_ifname, "the interface that routes to {{first_host}}"),
}


def known() -> dict[str, Placeholder]:
    """Every placeholder: the common ones, then each registered scheduler's."""
    found = dict(COMMON)
    for model in options_models().values():
        found.update(model.placeholders)
    return found


def substitute(text: str, env: Mapping[str, str] | None = None) -> str:
    """``text`` with every ``{{name}}`` replaced by its value on this node (each looked up once).

    Raises PlaceholderError for an unknown name or a value this node cannot find."""
    env = os.environ if env is None else env
    placeholders = known()
    values: dict[str, str] = {}
    for name in set(PATTERN.findall(text)):
        if name not in placeholders:
            raise PlaceholderError(f"unknown placeholder {{{{{name}}}}}: known are {', '.join(placeholders)}")
        try:
            values[name] = placeholders[name].resolve(env)
        except ValueError as e:
            raise PlaceholderError(f"{{{{{name}}}}}: {e}") from None
    return PATTERN.sub(lambda m: values[m.group(1)], text)


def help_text() -> str:
    """The placeholders and where each comes from, for ``launcher render --help``."""
    listed = ", ".join(f"{{{{{name}}}}} ({p.help})" for name, p in known().items())
    return f"placeholders (values only a node knows, filled in by `python -m launcher.job.node`): {listed}"
