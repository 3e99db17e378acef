"""``deploy/ssh/dev-hosts.sh`` itself: a host removed by a smaller ``up --hosts`` and added back by a
bigger one must answer at once. The root namespace and the other hosts may still cache a neighbour
(ARP) entry for its address; with a new MAC behind that address the first packets went nowhere until
the kernel gave up on the entry (about 8 s), and ``up`` failed with "sshd does not accept a login
within 5s". The test changes the machine-wide set of hosts, so it restores the original count.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.conftest import missing_component, run, wait_for

pytestmark = pytest.mark.alone  # see conftest.pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[2]
HOSTS_SCRIPT = ROOT / "deploy" / "ssh" / "dev-hosts.sh"
STATE = Path(os.environ.get("GPTLAUNCH_SSH_STATE", "/var/lib/gptlaunch-ssh"))
N_HOSTS = 8  # what test_ssh.py brings up, hence what is left up when no hosts were up before


def dev_hosts(*args: str) -> subprocess.CompletedProcess[str]:
    return run(["bash", str(HOSTS_SCRIPT), *args], timeout=120)


def up(n: int) -> float:
    """``dev-hosts.sh up --hosts n``, which must succeed; returns how long it took."""
    t0 = time.monotonic()
    proc = dev_hosts("up", "--hosts", str(n))
    assert proc.returncode == 0, f"up --hosts {n} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return time.monotonic() - t0


def ip_json(netns: str | None, *args: str) -> list[dict[str, object]]:
    ns = ["-n", netns] if netns else []
    proc = run(["ip", *ns, "-j", *args], check=True, timeout=10)
    return list(json.loads(proc.stdout or "[]"))


def neighbour_macs(netns: str | None, addr: str) -> list[str]:
    """The MACs cached for ``addr`` in a namespace's neighbour table (entries without one left out)."""
    return [str(e["lladdr"]) for e in ip_json(netns, "neigh", "show", "to", addr) if "lladdr" in e]


def eth0_mac(netns: str) -> str:
    (link,) = ip_json(netns, "link", "show", "eth0")
    return str(link["address"])


def ssh_banner_from(netns: str, addr: str) -> str:
    """The SSH greeting of ``addr``:22 read from inside host ``netns`` (host-to-host traffic, whose
    neighbour cache `up` itself never refreshes), giving up after 3 s."""
    script = 'exec 3<>"/dev/tcp/$1/22" && read -r -t 2 line <&3 && echo "$line"'
    argv = ["ip", "netns", "exec", netns, "timeout", "3", "bash", "-c", script, "bash", addr]
    return run(argv, timeout=10).stdout.strip()


def hosts_up_now() -> int | None:
    try:
        return int((STATE / "nhosts").read_text())
    except (OSError, ValueError):
        return None


def test_a_host_removed_then_added_back_accepts_a_login_at_once() -> None:
    if os.geteuid() != 0:
        missing_component("the SSH test hosts need root (network namespaces)")
    original = hosts_up_now() or N_HOSTS
    n = max(original, 2)  # the set shrinks by one and keeps gl-h1
    proc = dev_hosts("up", "--hosts", str(n))
    if proc.returncode != 0:
        missing_component(f"dev-hosts.sh up failed:\n{proc.stderr[-3000:]}")
    last, addr = f"gl-h{n}", f"10.231.0.{10 + n}"
    try:
        macs = []
        for cycle in range(2):  # the second cycle re-makes a host made by the fixed script
            # Caches as a running job leaves them: the root namespace and gl-h1 both talked to it.
            # (Waited for: an older dev-hosts.sh may have left a stale entry, which takes ~8 s to go.)
            run(["ssh", "-o", "ConnectTimeout=2", last, "true"], check=True, timeout=30)
            wait_for(
                lambda: ssh_banner_from("gl-h1", addr).startswith("SSH-2.0-"), 20, f"gl-h1 to reach {last}"
            )
            assert neighbour_macs(None, addr) == [eth0_mac(last)], "no cached entry: nothing to go stale"

            up(n - 1)
            assert not Path("/run/netns", last).exists()
            grow_s = up(n)  # fails (after the script's 5 s wait) if a stale MAC stays cached

            macs.append(eth0_mac(last))
            assert set(neighbour_macs(None, addr)) <= {macs[-1]}, f"cycle {cycle}: stale entry in root"
            login = run(["ssh", "-o", "ConnectTimeout=2", last, "hostname"], timeout=30)
            assert (login.returncode, login.stdout.strip()) == (0, last), login.stderr[-2000:]
            banner = ssh_banner_from("gl-h1", addr)  # no retry: it must answer at once
            assert banner.startswith("SSH-2.0-"), f"cycle {cycle}: gl-h1 cannot reach {last}: {banner!r}"
            assert set(neighbour_macs("gl-h1", addr)) <= {macs[-1]}, f"cycle {cycle}: stale entry in gl-h1"
            assert grow_s < 4, f"cycle {cycle}: up --hosts {n} took {grow_s:.1f} s"
        assert macs[0] == macs[1], "a re-made host answers to the MAC it had, whatever still caches it"

        status = dev_hosts("status")
        assert status.returncode == 0, status.stdout
        rows = {line.split()[0]: line.split()[1:] for line in status.stdout.splitlines() if line.strip()}
        assert rows[last][:2] == [addr, "up:"], status.stdout
    finally:
        up(original)
