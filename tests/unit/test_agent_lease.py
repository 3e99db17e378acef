"""The node agent's command line with real processes. Its lease over ssh: a node whose launcher goes
silent, or whose connection closes, kills its command's tree; one that keeps hearing from it runs to
the end. Its short answers (status, probe): typed reports on its channel."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from gptlaunch.contract import Beat, write_beat
from launcher.agent.node import KILL_GRACE_S
from launcher.agent.transport import channel_reports
from launcher.job.reports import NodeStatus, Probed

LEASE_S = 1.0


def _agent(tmp_path: Path, *command: str) -> subprocess.Popen[bytes]:
    """``launcher.agent run`` of ``command`` with a lease of LEASE_S, its secrets line already sent."""
    argv = [sys.executable, "-m", "launcher.agent", "run", "--job", "j1", "--node", "0"]
    env = os.environ | {"XDG_STATE_HOME": str(tmp_path)}
    agent = subprocess.Popen([*argv, f"--lease-s={LEASE_S}", "--", *command], stdin=subprocess.PIPE, env=env)
    assert agent.stdin is not None
    agent.stdin.write(json.dumps({}).encode() + b"\n")
    agent.stdin.flush()
    return agent


def _log(tmp_path: Path) -> str:
    return (tmp_path / "gptlaunch" / "jobs" / "j1" / "node-0.log").read_text()


def _sleeper_pid(agent: subprocess.Popen[bytes]) -> int:
    """The pid of the agent's ``sleep`` child, once it runs."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = psutil.Process(agent.pid).children()
        if children:
            return children[0].pid
        time.sleep(0.05)
    raise AssertionError("the agent started no child within 30 s")


def test_a_silent_launcher_ends_the_node_at_once(tmp_path: Path) -> None:
    agent = _agent(tmp_path, "sleep", "600")
    sleeper = _sleeper_pid(agent)
    started = time.monotonic()
    code = agent.wait(timeout=60)
    # The lease runs from the agent's start, which is before the child's: at most LEASE_S after it.
    assert time.monotonic() - started <= LEASE_S + 5
    assert code == 128 + 9 and not psutil.pid_exists(sleeper)  # SIGKILL: no chance to checkpoint
    assert f"no word from the launcher for {LEASE_S:.0f} s" in _log(tmp_path)


def test_a_closed_connection_ends_the_node(tmp_path: Path) -> None:
    agent = _agent(tmp_path, "sleep", "600")
    sleeper = _sleeper_pid(agent)
    assert agent.stdin is not None
    agent.stdin.close()
    assert agent.wait(timeout=60) == 128 + 9 and not psutil.pid_exists(sleeper)
    assert "the connection to the launcher closed" in _log(tmp_path)


def test_a_node_that_keeps_hearing_from_the_launcher_runs_to_its_end(tmp_path: Path) -> None:
    """A command that lasts 3 leases, a byte every half lease: it ends on its own, exit 0."""
    agent = _agent(tmp_path, sys.executable, "-c", f"import time; time.sleep({3 * LEASE_S})")
    assert agent.stdin is not None
    while agent.poll() is None:
        try:
            agent.stdin.write(b"\n")
            agent.stdin.flush()
        except BrokenPipeError:  # it ended between poll() and the write
            break
        time.sleep(LEASE_S / 2)
    agent.wait(timeout=60)
    assert agent.returncode == 0, _log(tmp_path)
    assert "launcher" not in _log(tmp_path)


def test_status_is_a_typed_report_on_the_agents_channel(tmp_path: Path) -> None:
    """``launcher.agent status`` of a node that ended with 3, one rank's beat kept: one ``status``
    report framed on stdout, read back typed as the ssh scheduler reads it."""
    state = tmp_path / "state"
    (state / "node-0.heartbeat").mkdir(parents=True)
    (state / "node-0.exit").write_text("3")
    beat = Beat(
        rank=1, local_rank=0, pid=1, step=9, phase="step", phase_since=0.0, time=5.0, slowest_step_s=0.1
    )
    write_beat(state / "node-0.heartbeat", beat)
    argv = [
        sys.executable,
        "-m",
        "launcher.agent",
        "status",
        "--job",
        "j1",
        "--node",
        "0",
        f"--state-dir={state}",
    ]
    out = subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout
    output, found = channel_reports(out)
    assert output == "" and found == [
        NodeStatus(node=0, running=False, exit_code=3, beats=[beat], time=found[0].time)
    ]


def test_a_kill_answers_with_the_nodes_status_once_its_tree_is_gone(tmp_path: Path) -> None:
    """``launcher.agent signal --signal KILL``: the agent and its command end, and the answer is the
    node's status (not running), so the launcher asks the host no more."""
    argv = [sys.executable, "-m", "launcher.agent", "run", "--job", "j1", "--node", "0", "--lease-s=600"]
    env = os.environ | {"XDG_STATE_HOME": str(tmp_path)}
    agent = subprocess.Popen([*argv, "--", "sleep", "600"], stdin=subprocess.PIPE, env=env)
    assert agent.stdin is not None
    agent.stdin.write(b"{}\n")
    agent.stdin.flush()
    sleeper = _sleeper_pid(agent)
    kill = [
        sys.executable,
        "-m",
        "launcher.agent",
        "signal",
        "--job",
        "j1",
        "--node",
        "0",
        "--signal",
        "KILL",
    ]
    out = subprocess.run(
        [*kill, "--grace-s", "0"], env=env, capture_output=True, check=True, timeout=60
    ).stdout
    assert agent.wait(timeout=30) != 0 and not psutil.pid_exists(sleeper)
    _, found = channel_reports(out)
    assert [(r.node, r.running) for r in found if isinstance(r, NodeStatus)] == [(0, False)], found


def test_probe_is_a_typed_report_on_the_agents_channel() -> None:
    argv = [sys.executable, "-m", "launcher.agent", "probe", "--node", "2", "--free-port"]
    out = subprocess.run(argv, capture_output=True, check=True, timeout=120).stdout
    output, found = channel_reports(out)
    assert output == "" and len(found) == 1 and isinstance(found[0], Probed), found
    probe = found[0].probe
    assert found[0].node == 2 and probe.hostname == socket.gethostname() and probe.free_port is not None
    assert probe.python_executable == sys.executable


# A torchrun stand-in that, asked to stop, stops its rank and then never ends (as torchrun waiting at
# exit for log-tail threads that a signal kept it from stopping).
LINGERING = """
import signal, subprocess, sys, threading
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
def stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank.terminate()
    rank.wait()
    threading.Event().wait()
signal.signal(signal.SIGTERM, stop)
rank.wait()
"""


def test_a_torchrun_that_outlives_its_stopped_ranks_is_ended(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "launcher.agent", "run", "--job", "j1", "--node", "0"]
    argv += [f"--state-dir={tmp_path}", "--", sys.executable, "-c", LINGERING]
    (tmp_path / "secrets").write_text("{}\n")
    with open(tmp_path / "secrets", "rb") as secrets:
        agent = subprocess.Popen(argv, stdin=secrets, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while len(tree := psutil.Process(agent.pid).children(recursive=True)) < 2:
        assert time.monotonic() < deadline, "the stand-in did not start its rank within 30 s"
        time.sleep(0.05)
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=KILL_GRACE_S + 60)  # without the bound: for ever
    output, _ = channel_reports(out)
    assert agent.returncode == 128 + 9, output
    assert "the ranks ended but torchrun did not" in output
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
