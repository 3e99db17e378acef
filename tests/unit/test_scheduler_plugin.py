"""A scheduler is one folder plus one registry line: one defined under tests/ and registered through an
entry point (as a package outside this repository would) shows its flags and renders a dry run, with
no file under launcher/ edited for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.plugin.registry import installed


def _launcher(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # A dist-info directory on sys.path is how an installed package announces its entry points.
    env = os.environ | installed(site)
    code = "import sys; from launcher.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)


def test_a_schedulers_own_placeholder_is_listed_and_filled_in_on_the_node(tmp_path: Path) -> None:
    helped = _launcher(tmp_path / "site", "render", "--help")
    assert "{{queue_slot}} (QUEUE_SLOT)" in " ".join(helped.stdout.split()), helped.stdout
    entry = [
        sys.executable,
        "-m",
        "launcher.job.node",
        "--",
        sys.executable,
        "-c",
        "print(__import__('sys').argv[1])",
    ]
    env = os.environ | installed(tmp_path / "site") | {"QUEUE_SLOT": "7"}
    filled = subprocess.run([*entry, "slot={{queue_slot}}"], capture_output=True, text=True, env=env)
    assert filled.stdout == "slot=7\n", filled.stderr
    del env["QUEUE_SLOT"]
    missing = subprocess.run([*entry, "{{queue_slot}}"], capture_output=True, text=True, env=env)
    assert missing.returncode != 0 and "QUEUE_SLOT is not set on this node" in missing.stderr


def test_a_scheduler_registered_outside_the_launcher_shows_its_flags_and_renders(tmp_path: Path) -> None:
    helped = _launcher(tmp_path / "site", "submit", "--scheduler", "queue", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--queue-name" in helped.stdout and "the made-up queue that takes the job" in helped.stdout
    assert "queue (with --scheduler queue)" in helped.stdout
    assert "local, compose, queue, slurm, ssh" in " ".join(helped.stdout.split())

    args = ["--jobs-root", str(tmp_path / "jobs"), "submit", "--scheduler", "queue", "--nodes", "2"]
    dry = _launcher(tmp_path / "site", *args, "--queue-name", "gold", "--dry-run", "--", "--max-steps", "3")
    assert dry.returncode == 0, dry.stderr
    assert "on scheduler queue: 2 node(s)" in dry.stdout
    assert "# node 1 on gold-1" in dry.stdout and "--rdzv-endpoint=127.0.0.1:" in dry.stdout
    assert "-m launcher.agent run --job" in dry.stdout  # the node agent, in the Plan it prints
    assert "queue_name=gold" in dry.stdout  # the typed facts, recorded in the Plan

    other = _launcher(tmp_path / "site", *args, "--partition", "gpu", "--dry-run")
    assert other.returncode == 2 and "it is an option of --scheduler slurm" in other.stderr


def test_without_the_entry_point_the_scheduler_does_not_exist(tmp_path: Path) -> None:
    code = "from launcher.job.registry import scheduler_kinds; print(scheduler_kinds())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "queue" not in out.stdout and "local" in out.stdout
