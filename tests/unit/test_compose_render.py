"""The compose scheduler's Plan and compose file, without an engine: one service per node on the job
network, the image pinned by id, same-path mounts (text read-only), `$` kept literal, GPUs split per
node, text files mounted by the names given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gptlaunch.contract import EXIT_REFUSED
from launcher.image.engine import DEFAULT_HOST, engine_env, with_engine
from launcher.job import reports
from launcher.job.spec import JobSpec
from launcher.preflight.probe import collect
from launcher.schedulers.compose.options import ComposeOptions
from launcher.schedulers.compose.scheduler import ComposeFacts, ComposeScheduler

IMAGE_ID = "sha256:" + "c" * 64


def facts(workdir: Path, gpus: bool = False) -> dict[str, Any]:
    return {
        "workdir": str(workdir), "image": "gptlaunch:cpu", "image_id": IMAGE_ID,
        "compose": ["docker-compose"], "gpus": gpus, "user": "1000:1000", "rdzv_port": 29500,
        "omp_num_threads": 1, "docker_env": {},
    }  # fmt: skip


def render(
    tmp_path: Path, trainer_args: list[str], gpus: bool = False, nproc: int = 1
) -> tuple[Any, dict[str, Any]]:
    spec = JobSpec(
        nnodes=2,
        nproc_per_node=nproc,
        scheduler=ComposeOptions(image="gptlaunch:cpu"),
        trainer_args=trainer_args,
    )
    plan = ComposeScheduler().render(
        spec, ComposeFacts(**facts(tmp_path, gpus)), "job-1", tmp_path / "jobs" / "job-1"
    )
    return plan, yaml.safe_load(plan.files[plan.primary])


def test_one_service_per_node_on_the_job_network(tmp_path: Path) -> None:
    text = tmp_path / "valid.txt"
    text.write_text("some text\n")
    plan, doc = render(tmp_path, ["--text-files", "valid.txt", "--max-steps", "3"])
    assert list(doc["services"]) == ["node0", "node1"] and list(doc["networks"]) == ["job"]
    for k, service in enumerate(doc["services"].values()):
        assert service["image"] == IMAGE_ID and service["hostname"] == f"node{k}"
        assert service["networks"] == ["job"] and service["shm_size"] == "8g"
        assert service["environment"]["GLOO_SOCKET_IFNAME"] == "eth0"
        assert service["environment"]["GPTLAUNCH_IMAGE_DIGEST"] == IMAGE_ID
        command = service["command"]
        assert (
            command[:3] == ["python", "-m", "launcher.schedulers.compose.node"]
            and f"--node={k}" not in command
        )
        assert command[command.index("--node") + 1] == str(k)
        assert "--rdzv-endpoint=node0:29500" in command
        volumes = service["volumes"]
        assert f"{text}:{text}:ro" in volumes
        assert f"{plan.run_dir}:{plan.run_dir}:rw" in volumes
        assert "deploy" not in service
    # compose substitutes ${...}: the file doubles every $ so torchrun gets its template as written
    assert (
        doc["services"]["node0"]["environment"]["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank$${rank}]: "
    )


def test_gpus_are_split_between_the_nodes(tmp_path: Path) -> None:
    _, doc = render(tmp_path, ["--max-steps", "3"], gpus=True, nproc=2)
    devices = [s["deploy"]["resources"]["reservations"]["devices"][0] for s in doc["services"].values()]
    assert [d["device_ids"] for d in devices] == [["0", "1"], ["2", "3"]]
    assert all(d["capabilities"] == ["gpu"] for d in devices)


def test_text_files_are_mounted_by_the_names_the_trainer_opens(tmp_path: Path) -> None:
    # a data dir reached through a symlink (as ../shared -> /work/shared): the container has only the
    # paths that are mounted, so the mount target must be the name as given, not the resolved one
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.txt").write_text("a\n")
    (real / "b.txt").write_text("b\n")
    (tmp_path / "link").symlink_to(real)
    _, doc = render(tmp_path, ["--text-files", "link/a.txt", "link/*.txt"])
    volumes = doc["services"]["node1"]["volumes"]
    for name in ("a.txt", "b.txt"):
        given = tmp_path / "link" / name
        assert volumes.count(f"{given}:{given}:ro") == 1
    assert not any(str(real) in v for v in volumes)


def test_the_compose_options_are_checked() -> None:
    with pytest.raises(ValueError, match="needs an image"):
        ComposeOptions()
    with pytest.raises(ValueError, match="not an image reference"):
        ComposeOptions(image="bad image;rm")
    with pytest.raises(ValueError, match="not a size"):
        ComposeOptions(image="x", shm_size="lots")


def _node0(job_dir: Path, stdin: str, *command: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "launcher.schedulers.compose.node",
        "--job-dir",
        str(job_dir),
        "--node",
        "0",
        "--nodes",
        "2",
    ]
    return subprocess.run([*argv, "--", *command], input=stdin, capture_output=True, text=True, timeout=120)


def test_a_container_checks_parity_then_runs_the_command_with_the_secrets(tmp_path: Path) -> None:
    (tmp_path / "parity").mkdir()
    peer = collect().model_copy(update={"hostname": "node1"})
    (tmp_path / "parity" / "node-1.json").write_text(peer.model_dump_json())
    show = "import os; print('secret=' + os.environ['HF_TOKEN'])"
    ok = _node0(tmp_path, json.dumps({"HF_TOKEN": "hf_x"}) + "\n", sys.executable, "-c", show)
    assert ok.returncode == 0, ok.stderr
    assert "version parity: the 2 nodes match" in ok.stdout and "secret=hf_x" in ok.stdout
    assert "secrets given to torchrun: HF_TOKEN" in ok.stdout and "hf_x" not in ok.stdout.split("secret=")[0]
    other = peer.model_copy(update={"torch": "2.12.0"})
    (tmp_path / "parity" / "node-1.json").write_text(other.model_dump_json())
    refused = _node0(tmp_path, "", sys.executable, "-c", "print('trained')")
    assert refused.returncode == EXIT_REFUSED and "trained" not in refused.stdout
    assert "torch: " in refused.stderr and "2.12.0" in refused.stderr
    (refusal,) = reports.read(tmp_path, reports.Refused)
    assert (refusal.node, refusal.check, refusal.exit_code) == (0, "parity", EXIT_REFUSED)


def test_docker_calls_go_to_the_engine_recorded_at_submit(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert engine_env() == {"DOCKER_HOST": DEFAULT_HOST}  # set even when unset: no docker context wins
    recorded = {"DOCKER_HOST": "unix:///run/job-engine.sock"}
    # a later shell pointed at a TLS engine: none of its engine variables may reach the job's engine
    monkeypatch.setenv("DOCKER_HOST", "tcp://elsewhere:2376")
    monkeypatch.setenv("DOCKER_TLS_VERIFY", "1")
    monkeypatch.setenv("DOCKER_CERT_PATH", "/elsewhere/certs")
    assert engine_env()["DOCKER_CERT_PATH"] == "/elsewhere/certs"
    env = with_engine(recorded)
    assert env["DOCKER_HOST"] == recorded["DOCKER_HOST"]
    assert "DOCKER_TLS_VERIFY" not in env and "DOCKER_CERT_PATH" not in env
    assert env["PATH"] == os.environ["PATH"]
