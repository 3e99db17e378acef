"""Late-bound values: {{placeholders}} stay literal in the Plan and are filled in on the node."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launcher.job.placeholders import PlaceholderError, substitute
from launcher.job.plan import NodePlan


def test_node_rank_comes_from_slurm_or_our_own_variable() -> None:
    assert substitute("--node-rank={{node_rank}}", {"SLURM_NODEID": "3"}) == "--node-rank=3"
    assert substitute("{{node_rank}}", {"GPTLAUNCH_NODE_RANK": "1"}) == "1"


def test_first_host_without_slurm_comes_from_our_variable() -> None:
    assert substitute("{{first_host}}:29500", {"GPTLAUNCH_FIRST_HOST": "n1"}) == "n1:29500"


def test_the_interface_is_the_one_that_routes_to_the_first_host() -> None:
    assert substitute("{{ifname}}", {"GPTLAUNCH_FIRST_HOST": "127.0.0.1"}) == "lo"


def test_an_unknown_or_unresolvable_placeholder_names_the_problem() -> None:
    with pytest.raises(PlaceholderError, match="unknown placeholder"):
        substitute("{{nodes}}", {})
    with pytest.raises(PlaceholderError, match="SLURM_NODEID"):
        substitute("{{node_rank}}", {})
    with pytest.raises(PlaceholderError, match="does not resolve"):
        substitute("{{ifname}}", {"GPTLAUNCH_FIRST_HOST": "no-such-host.invalid"})


def test_the_node_entry_point_fills_in_argv_and_env_then_execs(tmp_path) -> None:
    probe = (
        "import json, os, sys; "
        "print(json.dumps([sys.argv[1:], os.environ['WHERE'], os.environ['UNRELATED'], os.getpid()]))"
    )
    entry = [sys.executable, "-m", "launcher.job.node", "--fill-env", "WHERE", "--"]
    node = NodePlan(
        node_rank=0,
        host="n1",
        argv=[*entry, sys.executable, "-c", probe, "--rank={{node_rank}}", "$(x)"],
        env={
            "WHERE": "{{first_host}}",
            "UNRELATED": "{{not_ours}}",  # not named by --fill-env: left as it is
            "SLURM_NODEID": "1",
            "GPTLAUNCH_FIRST_HOST": "n1",
        },
        cwd=str(tmp_path),
        log="node-0.log",
    )
    # The Plan's shell line keeps the placeholder literal and quoted; the node fills it in.
    assert "'--rank={{node_rank}}'" in node.shell_command()
    out = subprocess.run(["bash", "-c", node.shell_command()], capture_output=True, text=True, timeout=60)
    args, where, unrelated, _ = json.loads(out.stdout)
    assert args == ["--rank=1", "$(x)"] and where == "n1" and unrelated == "{{not_ours}}"
    direct = subprocess.Popen(node.argv, env=node.env, stdout=subprocess.PIPE, text=True)
    *_, pid = json.loads(direct.communicate(timeout=60)[0])
    assert pid == direct.pid, "exec: signals sent to the node's process reach the program itself"
