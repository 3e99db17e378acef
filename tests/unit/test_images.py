"""The pinned image on SSH hosts and SLURM nodes, rendered without a registry or runtime: references
pinned by digest, the container runtimes' command lines, the mounts, the options' checks, and the
golden sbatch scripts of pyxis and Apptainer (which cannot run on these machines)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from launcher.cli.main import main
from launcher.image.reference import is_pinned, repository
from launcher.image.runtime import Container
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import container_mounts
from launcher.schedulers.slurm.image import pyxis_image
from launcher.schedulers.slurm.scheduler import SlurmFacts, SlurmScheduler
from launcher.schedulers.ssh.options import SshOptions
from launcher.schedulers.ssh.scheduler import SshFacts, SshScheduler

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
DIGEST = "sha256:" + "ab" * 32
IMAGE = f"registry.example.com:5000/team/gpt@{DIGEST}"
HOSTILE_DIR = "/jobs/a 'b' $(touch c);d"


def _check_golden(text: str, name: str) -> None:
    golden = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"rendering changed: UPDATE_GOLDEN=1 pytest {__file__} to accept"


@pytest.mark.parametrize(
    ("ref", "repo", "pinned"),
    [
        ("gpt:cpu", "gpt", False),
        ("host:5000/team/gpt:cpu", "host:5000/team/gpt", False),
        ("host:5000/team/gpt", "host:5000/team/gpt", False),
        (f"host:5000/gpt@{DIGEST}", "host:5000/gpt", True),
        (f"host:5000/gpt:cpu@{DIGEST}", "host:5000/gpt", True),
        (f"gpt@{DIGEST}", "gpt", True),
        ("gpt", "gpt", False),
    ],
)
def test_references_and_their_repository(ref: str, repo: str, pinned: bool) -> None:
    assert repository(ref) == repo and is_pinned(ref) is pinned


def test_enroot_separates_the_registry_with_a_hash() -> None:
    assert pyxis_image(IMAGE) == f"registry.example.com:5000#team/gpt@{DIGEST}"
    assert pyxis_image(f"localhost/gpt@{DIGEST}") == f"localhost#gpt@{DIGEST}"
    assert pyxis_image(f"team/gpt@{DIGEST}") == f"team/gpt@{DIGEST}"  # Docker Hub: no registry part


@pytest.mark.parametrize(
    ("runtime", "gpu_flag"), [("docker", "--gpus=all"), ("podman", "--device=nvidia.com/gpu=all")]
)
def test_a_node_container_shares_the_hosts_namespaces_and_gets_gpus_the_runtimes_way(
    runtime: str, gpu_flag: str
) -> None:
    container = Container(runtime, IMAGE, "gptlaunch-j-node0", ("/jobs/j", "/data"), "/work")
    argv = container.run_argv(["torchrun", "x"], ["B", "A", "A"], gpus=True, user="1000:1000")
    assert argv[:3] == [runtime, "run", "--rm"] and argv[-3:] == [IMAGE, "torchrun", "x"]
    for flag in (
        "--network=host",
        "--ipc=host",
        "--pid=host",
        "--workdir=/work",
        "--user=1000:1000",
        gpu_flag,
    ):
        assert flag in argv
    assert "--volume=/jobs/j:/jobs/j" in argv and "--volume=/data:/data" in argv
    assert [a for a in argv if a.startswith("--env=") and "=" not in a[6:]] == ["--env=A", "--env=B"]
    assert not any(a.startswith("--shm-size") for a in argv)  # podman refuses it with --ipc=host
    assert gpu_flag not in container.run_argv(["x"], gpus=False)


def test_a_node_container_is_removed_at_once_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kwargs: ran.append(argv))
    Container("podman", IMAGE, "gptlaunch-j-node0", (), "/work").remove()
    assert ran == [["podman", "rm", "--force", "--time=0", "gptlaunch-j-node0"]]


def test_mounts_cover_the_record_workdir_and_data_once(tmp_path: Path) -> None:
    spec = JobSpec.model_validate(
        {
            "scheduler": {
                "kind": "ssh",
                "hosts": ["a"],
                "image": "r:5000/gpt:cpu",
                "container_mounts": ["/data", "/"],
            },
            "trainer_args": ["--text-files", "/data/w/a.txt", "corpus/*.txt", "--resume", "/ck/x.pt"],
        }
    )
    found = container_mounts(spec, "/jobs/j/run", "/work", Path("/jobs/j"))
    assert found == ("/ck", "/data", "/jobs/j", "/work")  # /data/w and /work/corpus are inside others


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--scheduler", "ssh", "--hosts", "a", "--image", "x", "--container-runtime", "pyxis"],
            "use docker or podman",
        ),
        (
            ["--scheduler", "slurm", "--image", "x", "--container-runtime", "docker"],
            "pyxis or apptainer or podman",
        ),
        (["--scheduler", "slurm", "--container-runtime", "podman"], "need an image"),
        (["--scheduler", "ssh", "--hosts", "a", "--container-mount", "/d"], "need an image"),
        (
            ["--scheduler", "slurm", "--image", "/i/gpt.sif", "--container-runtime", "podman"],
            "Apptainer image file",
        ),
        (["--scheduler", "slurm", "--image", "x y"], "not an image reference"),
        (["--scheduler", "slurm", "--image", "x", "--container-mount", "rel/dir"], "absolute directory"),
    ],
)
def test_bad_image_options_are_clear_errors(args: list[str], needle: str, tmp_path: Path, capsys) -> None:
    code = main(["--jobs-root", str(tmp_path), "render", *args])
    assert code == 2 and needle in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_ssh_nodes_run_torchrun_in_the_pinned_image_under_their_host_agent() -> None:
    spec = JobSpec.model_validate(
        {
            "scheduler": {"kind": "ssh", "hosts": ["a", "b"], "image": "r:5000/gpt:cpu"},
            "nnodes": 2,
            "secret_env": ["MY_TOKEN"],
            "trainer_args": ["--text-files", "/data/w/a.txt"],
        }
    )
    assert spec.options(SshOptions).container_runtime == "auto"
    facts = {
        "workdir": "/w", "hosts": ["a", "b"], "master_addr": "a", "rdzv_port": 29500,
        "ifnames": {"a": "eth0", "b": "eth0"}, "omp_num_threads": None, "image": IMAGE,
        "runtimes": {"a": "podman", "b": "docker"},
    }  # fmt: skip
    plan = SshScheduler().render(spec, SshFacts(**facts), "job-1", Path("/jobs/job-1"))
    words = shlex.split(plan.nodes[1].shell_command())
    agent = words.index("launcher.agent")
    cut = words.index("--", agent)
    flags = words[agent:cut]
    assert f"--image={IMAGE}" in flags and "--runtime=docker" in flags
    assert {"--mount=/jobs/job-1", "--mount=/w", "--mount=/data/w"} <= set(flags)
    assert "--env-name=GLOO_SOCKET_IFNAME" in flags and "--env-name=GPTLAUNCH_JOB_ID" in flags
    assert words[cut + 1 : cut + 4] == ["python", "-m", "torch.distributed.run"]  # the image's interpreter
    assert not any("MY_TOKEN=" in w for w in words)  # a secret's value never on a command line


def _slurm_spec(runtime: str, image: str = "r:5000/gpt:cpu", **fields: object) -> JobSpec:
    base: dict[str, object] = {
        "name": "gold",
        "nnodes": 2,
        "nproc_per_node": 1,
        "python": "/opt/gptlaunch/bin/python",
        "scheduler": {"kind": "slurm", "time": "60", "image": image, "container_runtime": runtime},
        "trainer_args": ["--max-steps", "30", "--text-files", "/data/wiki/a b.txt"],
    }
    return JobSpec.model_validate(base | fields)


def _slurm_render(
    spec: JobSpec, runtime: str, image: str = IMAGE, job_dir: str = "/jobs/gold-job", gpus: int = 0
):
    facts = SlurmFacts(workdir="/work/job", gpus_per_node=gpus, image=image, runtime=runtime)
    return SlurmScheduler().render(spec, facts, "gold-job", Path(job_dir))


@pytest.mark.parametrize(("runtime", "gpus"), [("pyxis", 1), ("apptainer", 1), ("podman", 0)])
def test_slurm_image_scripts_match_golden_files(runtime: str, gpus: int) -> None:
    plan = _slurm_render(_slurm_spec(runtime), runtime, gpus=gpus)
    _check_golden(plan.to_text(), f"slurm_{runtime}.sbatch")
    text = plan.to_text().replace(" \\\n  ", " ")  # the script's long srun line, joined
    assert text.count(IMAGE if runtime != "pyxis" else pyxis_image(IMAGE)) >= 2  # the probe and the nodes
    assert '"--rdzv-endpoint=' in text and '"python", "-m", "torch.distributed.run"' in text


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_slurm_image_scripts_with_shell_hostile_paths_match_golden_files(runtime: str) -> None:
    spec = _slurm_spec(
        runtime, trainer_args=["--text-files", "/data/$(touch x)/a.txt", "--run-dir", "/r/`x` y"]
    )
    _check_golden(
        _slurm_render(spec, runtime, job_dir=HOSTILE_DIR).to_text(), f"slurm_{runtime}_hostile.sbatch"
    )


def test_an_apptainer_image_file_is_run_as_is() -> None:
    plan = _slurm_render(
        _slurm_spec("apptainer", image="/images/gpt.sif"), "apptainer", image="/images/gpt.sif"
    )
    argv = plan.nodes[0].argv  # each node's agent, in the image file
    assert argv[:2] == ["apptainer", "exec"] and argv[argv.index("/images/gpt.sif") + 1 :][:4] == [
        "python", "-m", "launcher.agent", "run",
    ]  # fmt: skip


def test_a_mount_with_a_separator_of_the_runtimes_is_refused() -> None:
    with pytest.raises(SpecError, match="contains ':' or ','"):
        _slurm_render(_slurm_spec("pyxis"), "pyxis", job_dir="/jobs/a,b")
