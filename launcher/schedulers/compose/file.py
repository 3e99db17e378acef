"""The compose file of a job (pure): one service per node of the Plan, on the job's own network, each
running ``python -m launcher.schedulers.compose.node`` in the image pinned by id, as the submitting user
(what each setting is for: ``docs/schedulers/compose.md``, "How a job runs")."""

from __future__ import annotations

from typing import Any

import yaml

from launcher.job.plan import NodePlan, container_name

NETWORK = "job"
COMPOSE_FILE = "compose.yaml"
Mount = tuple[str, bool]  # (host path, read-only), bind-mounted at the same path in every container


def service_name(node_rank: int) -> str:
    """The service (and hostname on the job network) of node ``node_rank``: node0 hosts the rendezvous."""
    return f"node{node_rank}"


def render(
    job_id: str,
    nodes: list[NodePlan],
    *,
    image_id: str,
    user: str,
    mounts: list[Mount],
    shm_size: str,
    gpus_per_node: int,
) -> str:
    """The compose file's text. ``gpus_per_node`` 0: no GPU reservation; else node k reserves GPUs
    k·G … k·G+G-1 of the engine's host."""
    services = {
        service_name(n.node_rank): _service(job_id, n, image_id, user, mounts, shm_size, gpus_per_node)
        for n in nodes
    }
    document = {  # no top-level `name`: docker-compose v1 rejects it (the project name is a flag)
        "services": services,
        "networks": {NETWORK: {"driver": "bridge", "labels": {"io.gptlaunch.job": job_id}}},
    }
    header = (
        f"# gptlaunch job {job_id}: one service per node on the private network {NETWORK!r}; node0 hosts\n"
        "# the rendezvous. Run by `launcher submit --scheduler compose` (which also tears it down).\n"
    )
    return header + yaml.safe_dump(_literal(document), sort_keys=False, width=100)


def _literal(value: Any) -> Any:
    """``value`` with every ``$`` doubled: compose substitutes ``${NAME}`` from its own environment
    (torchrun's ``[rank${rank}]`` log prefix must reach the container as written)."""
    if isinstance(value, str):
        return value.replace("$", "$$")
    if isinstance(value, dict):
        return {k: _literal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_literal(v) for v in value]
    return value


def _service(
    job_id: str, node: NodePlan, image_id: str, user: str, mounts: list[Mount], shm_size: str, gpus: int
) -> dict[str, Any]:
    service: dict[str, Any] = {
        "image": image_id,
        "container_name": container_name(job_id, node.node_rank),
        "hostname": service_name(node.node_rank),
        "user": user,  # the files a node writes on the host stay the submitting user's
        "working_dir": node.cwd,
        "command": node.argv,
        "environment": dict(sorted(node.env.items())),
        "volumes": [f"{path}:{path}:{'ro' if read_only else 'rw'}" for path, read_only in mounts],
        "shm_size": shm_size,
        "init": True,  # docker-init as PID 1: relays docker kill's signals, reaps strays
        "stdin_open": True,  # the secrets arrive on stdin, never in this file or the container's config
        "networks": [NETWORK],
        "labels": {"io.gptlaunch.job": job_id, "io.gptlaunch.node": str(node.node_rank)},
    }
    if gpus:  # node k's own GPUs: `count` alone would give every container the first ones
        ids = [str(node.node_rank * gpus + i) for i in range(gpus)]
        device = {"driver": "nvidia", "device_ids": ids, "capabilities": ["gpu"]}
        service["deploy"] = {"resources": {"reservations": {"devices": [device]}}}
    return service
