"""How the tests install the plugin scheduler as a package outside this repository would be: a
dist-info directory with its entry point, on PYTHONPATH."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def installed(site: Path) -> dict[str, str]:
    """The environment under which ``launcher`` finds the ``queue`` scheduler (registered in ``site``)."""
    dist = site / "gptlaunch_queue-0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: gptlaunch-queue\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[gptlaunch.schedulers]\nqueue = tests.plugin.queue_options:QueueOptions\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
