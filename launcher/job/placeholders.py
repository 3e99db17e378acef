"""Late-bound values: what only a node knows at run time, written as ``{{name}}`` in a Plan.

A SLURM allocation's first host, a node's index within the job, the network interface that reaches
the rendezvous host: none is known where the Plan is rendered. The Plan holds the placeholder instead
of a guess, so every value in it stays a literal that golden tests pin and shell quoting covers; the
node-side entry point (``python -m launcher.job.node -- ARGV...``) replaces them just before it execs ARGV.

Placeholders (``HELP`` below is what `launcher render --help` shows):

- ``{{node_rank}}``: this node's index, 0-based: ``SLURM_NODEID``, else ``GPTLAUNCH_NODE_RANK``.
- ``{{first_host}}``: the allocation's first host: ``GPTLAUNCH_FIRST_HOST`` (which a SLURM batch script
  sets), else the first name of ``SLURM_JOB_NODELIST`` (expanded by ``scontrol show hostnames``).
- ``{{ifname}}``: the interface this node routes ``{{first_host}}`` through (``ip route get``), for
  NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME.
- ``{{slurm_job_id}}``: ``SLURM_JOB_ID`` (the same across requeues): the rendezvous id of a SLURM job.
- ``{{rdzv_port}}``: a rendezvous port derived from ``SLURM_JOB_ID``, PORT_BASE + id mod PORT_SPAN:
  concurrent jobs whose first node is the same get different ports (unless their ids differ by a
  multiple of PORT_SPAN), below Linux's ephemeral range (32768-60999) so no outgoing connection
  holds it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Callable, Mapping

from trainer.contract import FIRST_HOST_ENV, NODE_RANK_ENV

PATTERN = re.compile(r"\{\{([a-z_]+)\}\}")
PORT_BASE, PORT_SPAN = 15000, 15000


class PlaceholderError(RuntimeError):
    """A placeholder that this node cannot fill in; the message says which variable is missing."""


def _first_env(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if env.get(name):
            return env[name]
    raise PlaceholderError(f"none of {', '.join(names)} is set on this node")


def _node_rank(env: Mapping[str, str]) -> str:
    return _first_env(env, "SLURM_NODEID", NODE_RANK_ENV)


def _first_host(env: Mapping[str, str]) -> str:
    # A SLURM batch script sets it too: where the node command runs (an image), scontrol may be missing.
    if env.get(FIRST_HOST_ENV):
        return env[FIRST_HOST_ENV]
    if env.get("SLURM_JOB_NODELIST"):
        out = _run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]])
        return out.split()[0]
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


def _slurm_job_id(env: Mapping[str, str]) -> str:
    job_id = _first_env(env, "SLURM_JOB_ID")
    if not job_id.isdigit():
        raise PlaceholderError(f"SLURM_JOB_ID={job_id!r} is not a number")
    return job_id


def _rdzv_port(env: Mapping[str, str]) -> str:
    return str(PORT_BASE + int(_slurm_job_id(env)) % PORT_SPAN)


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise PlaceholderError(f"`{' '.join(argv)}` failed: {e}") from None


RESOLVERS: dict[str, Callable[[Mapping[str, str]], str]] = {
    "node_rank": _node_rank,
    "first_host": _first_host,
    "ifname": _ifname,
    "slurm_job_id": _slurm_job_id,
    "rdzv_port": _rdzv_port,
}


def names_in(text: str) -> set[str]:
    """The placeholder names ``text`` uses."""
    return set(PATTERN.findall(text))


def substitute(text: str, env: Mapping[str, str] | None = None) -> str:
    """``text`` with every ``{{name}}`` replaced by its value on this node (each looked up once).

    Raises PlaceholderError for an unknown name or a value this node cannot find."""
    env = os.environ if env is None else env
    values: dict[str, str] = {}
    for name in names_in(text):
        if name not in RESOLVERS:
            raise PlaceholderError(f"unknown placeholder {{{{{name}}}}}: known are {', '.join(RESOLVERS)}")
        values[name] = RESOLVERS[name](env)
    return PATTERN.sub(lambda m: values[m.group(1)], text)


HELP = (
    "placeholders (values only a node knows, filled in on the node by `python -m launcher.job.node`): "
    "{{node_rank}} (SLURM_NODEID, else GPTLAUNCH_NODE_RANK), {{first_host}} (GPTLAUNCH_FIRST_HOST, "
    "else the first host of SLURM_JOB_NODELIST), {{ifname}} (the interface that routes to "
    "{{first_host}}), {{slurm_job_id}} (SLURM_JOB_ID), {{rdzv_port}} (15000 + SLURM_JOB_ID mod 15000)"
)
