"""The flight recorder against real torch: a gloo process group of one rank serves its recorder on the
Unix socket the trainer opens, and the launcher's reader finds the collectives it ran."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gptlaunch import flight_recorder
from launcher.supervisor import watchdog

RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from pathlib import Path
from gptlaunch import flight_recorder
print(flight_recorder.start(Path(sys.argv[1]), rank=0), flush=True)
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
x = torch.ones(3)
for _ in range(4):
    dist.all_reduce(x)
dist.broadcast(x, src=0)
print("ready", flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_the_collectives_a_rank_ran_are_read_from_its_worker_server(tmp_path: Path) -> None:
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK_SCRIPT, str(tmp_path / "beats"), str(tmp_path / "store")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    try:
        assert rank.stdout is not None
        socket = rank.stdout.readline().strip()
        assert socket == str(flight_recorder.socket_path(tmp_path / "beats", 0))
        assert rank.stdout.readline().strip() == "ready"
        trace = watchdog.fetch_trace(socket)
        assert isinstance(trace, dict), trace
        last = watchdog.last_collective(trace)
        assert last is not None and (last.pg, last.seq, last.op, last.done) == (0, 5, "gloo:broadcast", True)
        shown = watchdog.describe_trace(trace).splitlines()
        assert len(shown) == 5
        assert shown[0] == "  gloo:all_reduce #1 (process group 0, sizes [[3]]): done", shown
    finally:
        rank.communicate("", timeout=30)
    assert rank.returncode == 0 and not Path(socket).exists()  # the socket is removed at exit


def test_a_socket_nobody_serves_is_described_not_raised(tmp_path: Path) -> None:
    why = watchdog.fetch_trace(str(tmp_path / "nobody.sock"), timeout_s=1)
    assert isinstance(why, str) and "did not answer" in why
