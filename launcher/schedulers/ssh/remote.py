"""What the launcher runs on an SSH host, and for how long it waits: ``launcher.agent ACTION`` as a
remote shell command, and the hosts' lease. Shared by the scheduler (which renders and asks) and the
supervisor's transport (``agents``, which starts, signals and renews), so that neither imports the
other.
"""

from __future__ import annotations

import shlex

SIGNAL_TIMEOUT_S = 30.0  # for `launcher.agent signal/status` over an established connection
# The hosts' lease (``launcher.agent run --lease-s``): the supervisor writes a byte to every node's ssh stdin
# each LEASE_RENEW_S; a node that heard nothing for LEASE_S ends itself. Longer than ssh's own
# detection of a dead link (ServerAliveInterval 5 s × ServerAliveCountMax 3): the launcher gives up on
# a node before that node gives up on the launcher.
LEASE_S = 30.0
LEASE_RENEW_S = 5.0


def agent_command(python: str, action: str, job_id: str, node: int, *extra: str) -> str:
    """``launcher.agent ACTION`` of node ``node`` of ``job_id``, as a remote shell command."""
    argv = [python, "-m", "launcher.agent", action, "--job", job_id, "--node", str(node), *extra]
    return f"cd / && {shlex.join(argv)}"
