"""JobSpec -> Plan rendering: golden torchrun commands, quoting that survives a real shell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.job.plan import NodePlan, Plan
from launcher.job.spec import JobSpec, Program, SpecError
from launcher.job.torchrun import rdzv_backend, warm_workers, worker_argv
from launcher.schedulers.local.scheduler import LocalFacts, LocalScheduler
from launcher.schedulers.local.warm import zygote_socket

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def _golden_spec() -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "gold",
            "nnodes": 2,
            "nproc_per_node": 1,
            "python": "python3",
            "network": {"gloo_socket_ifname": "lo", "nccl_ib_disable": True, "env": {"EXTRA": "x y"}},
            "trainer_args": ["--max-steps", "30", "--text-files", "/data/a b.txt"],
        }
    )


# What LocalScheduler.resolve finds on a machine, fixed here so the rendering is pure.
FACTS = {
    "workdir": "/work/job",
    "rdzv_host": "127.0.0.1",
    "rdzv_port": 29555,
    "omp_num_threads": 1,
    "gpus": [],
    "agent_python": "/usr/bin/python3",
}


def _render(spec: JobSpec, **facts: object) -> Plan:
    return LocalScheduler().render(spec, LocalFacts(**FACTS | facts), "gold-job", Path("/jobs/gold-job"))


@pytest.mark.parametrize("form", ["txt", "json"])
def test_local_plan_matches_golden_file(form: str) -> None:
    plan = _render(_golden_spec())
    text = plan.to_text() if form == "txt" else plan.to_json() + "\n"
    golden = GOLDEN / f"local_2x1.{form}"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"rendering changed: UPDATE_GOLDEN=1 pytest {__file__} to accept"


def test_every_node_gets_the_same_rendezvous_and_its_own_log() -> None:
    plan = _render(_golden_spec())
    assert [n.node_rank for n in plan.nodes] == [0, 1]
    assert len({n.log for n in plan.nodes}) == 2
    for node in plan.nodes:
        assert "--rdzv-endpoint=127.0.0.1:29555" in node.argv
        assert "--rdzv-id=gold-job" in node.argv
        assert node.env["GLOO_SOCKET_IFNAME"] == "lo" and node.env["NCCL_IB_DISABLE"] == "1"
    assert plan.run_dir == "/jobs/gold-job/run"


def test_auto_rendezvous_is_static_where_node_0_holds_the_store_else_c10d() -> None:
    spec = _golden_spec()
    for k, node in enumerate(_render(spec).nodes):
        assert "--rdzv-backend=static" in node.argv and f"--node-rank={k}" in node.argv
        assert "--rdzv-conf=timeout=600" in node.argv  # static's name for the join timeout
    elsewhere = spec.rendezvous.model_copy(update={"endpoint": "10.0.0.9"})  # the store off node 0
    assert rdzv_backend(elsewhere) == "c10d"
    chosen = spec.model_copy(update={"rendezvous": spec.rendezvous.model_copy(update={"backend": "c10d"})})
    argv = _render(chosen).nodes[0].argv
    assert "--rdzv-backend=c10d" in argv and not any(a.startswith("--node-rank") for a in argv)
    assert "--rdzv-conf=join_timeout=600,last_call_timeout=30" in argv


def test_run_dir_is_added_only_when_absent() -> None:
    def worker(*args: str) -> tuple[list[str], str]:
        return worker_argv(JobSpec.model_validate({"trainer_args": list(args)}), Path("/j/run"))

    assert worker("--max-steps", "3") == (
        ["-m", "trainer.cli", "train", "--max-steps", "3", "--run-dir", "/j/run"],
        "/j/run",
    )
    assert worker("--run-dir=/mine") == (["-m", "trainer.cli", "train", "--run-dir=/mine"], "/mine")


HOSTILE = ["a'; touch {m}", "$(touch {m})", "`touch {m}`", "two  spaces", 'a"=0"', "semi;colon", "*", "~"]


def test_shell_command_passes_hostile_values_through_bash_verbatim(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    values = [h.format(m=marker) for h in HOSTILE]
    cwd = tmp_path / "dir with 'quote' and $(touch x)"
    cwd.mkdir()
    probe = "import json,os,sys; print(json.dumps([sys.argv[1:], os.environ['HOSTILE'], os.getcwd()]))"
    node = NodePlan(
        node_rank=0,
        host="localhost",
        argv=[sys.executable, "-c", probe, *values],
        env={"HOSTILE": values[1]},
        cwd=str(cwd),
        log="node-0.log",
    )
    out = subprocess.run(["bash", "-c", node.shell_command()], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [values, values[1], str(cwd)]
    assert not marker.exists()


def test_emulated_nodes_on_a_gpu_machine_get_disjoint_devices() -> None:
    # The user's own CUDA_VISIBLE_DEVICES selection (here 4-7) is what gets shared out.
    spec = JobSpec.model_validate(
        {"nnodes": 2, "nproc_per_node": 2, "network": {"env": {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}}}
    )
    plan = _render(spec, gpus=LocalScheduler().resolve(spec).gpus)
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in plan.nodes] == ["4,5", "6,7"]


def test_more_processes_than_gpus_is_refused() -> None:
    spec = JobSpec.model_validate(
        {"nnodes": 2, "nproc_per_node": 2, "scheduler": {"kind": "local", "gpus": ["0", "1", "2"]}}
    )
    with pytest.raises(SpecError, match="need 4 GPUs"):
        LocalScheduler().resolve(spec)


def test_warm_workers_run_each_rank_through_the_zygote_client_and_refuse_a_no_python_program() -> None:
    spec = JobSpec.model_validate({"nnodes": 2, "scheduler": {"kind": "local", "warm_workers": True}})
    argv = _render(spec).nodes[0].argv
    tail = argv[argv.index("gptlaunch.warm") - 1 :]
    assert tail[:5] == ["-m", "gptlaunch.warm", "run", str(zygote_socket("gold-job")), "--"], argv
    assert tail[5:8] == ["-m", "trainer.cli", "train"]
    assert len(str(zygote_socket("x" * 200))) < 108  # a Unix socket's path, whatever the job's name
    no_python = spec.model_copy(update={"program": Program(kind="no_python", target="./a.out")})
    with pytest.raises(SpecError, match="--warm-workers"):
        LocalScheduler().resolve(no_python)


def test_warm_workers_are_on_by_default_only_where_a_retry_may_follow() -> None:
    def warm(scheduler: dict[str, object], **job: object) -> bool:
        return (
            "gptlaunch.warm" in _render(JobSpec.model_validate({"scheduler": scheduler, **job})).nodes[0].argv
        )

    local = {"kind": "local"}
    assert warm(local, retries=1) and not warm(local)  # no retry: no rank would ever start warm
    assert not warm(local | {"warm_workers": False}, retries=1)  # as asked, both ways
    assert warm(local | {"warm_workers": True})
    # Not for a binary (it starts its own interpreter): no error either.
    binary = {"kind": "no_python", "target": "./a.out"}
    assert not warm_workers(JobSpec.model_validate({"scheduler": local, "retries": 1, "program": binary}))
    ssh = {"kind": "ssh", "hosts": ["a"]}
    assert warm_workers(JobSpec.model_validate({"scheduler": ssh, "retries": 1}))
    assert not warm_workers(JobSpec.model_validate({"scheduler": ssh, "retries": 0}))
    in_image = ssh | {"image": "registry.example/gpt@sha256:" + "0" * 64}  # the ranks run in containers
    assert not warm_workers(JobSpec.model_validate({"scheduler": in_image, "retries": 1}))
    assert not warm_workers(JobSpec.model_validate({"scheduler": {"kind": "slurm"}, "retries": 1}))


def test_omp_num_threads_from_env_is_honoured_not_overridden() -> None:
    spec = JobSpec.model_validate({"nnodes": 2, "network": {"env": {"OMP_NUM_THREADS": "3"}}})
    plan = _render(spec, omp_num_threads=LocalScheduler().resolve(spec).omp_num_threads)
    assert {n.env["OMP_NUM_THREADS"] for n in plan.nodes} == {"3"}


def test_resolved_facts_go_to_the_plan_and_the_spec_stays_as_asked() -> None:
    spec = JobSpec.model_validate({"nnodes": 2})
    facts = LocalScheduler().resolve(spec)
    plan = LocalScheduler().render(spec, facts, "j", Path("/jobs/j"))
    assert plan.facts["rdzv_port"] == facts.rdzv_port > 0 and plan.rdzv_endpoint.endswith(
        f":{facts.rdzv_port}"
    )
    assert spec.rendezvous.port is None and spec.workdir is None


def test_the_default_workdir_is_the_current_directory_at_submit_not_at_import(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert LocalScheduler().resolve(JobSpec()).workdir == str(tmp_path)


def test_a_malformed_thread_count_from_the_environment_is_a_clear_error() -> None:
    spec = JobSpec.model_validate({"network": {"env": {"OMP_NUM_THREADS": "many"}}})
    with pytest.raises(SpecError, match="OMP_NUM_THREADS='many'"):
        LocalScheduler().resolve(spec)


def test_torchrun_reads_the_shutdown_grace_from_the_environment_it_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The grace reaches torchrun as a variable, which a torchrun without the flag ignores (torch 2.11
    refuses ``--shutdown-timeout``); this torchrun must still read it."""
    from torch.distributed.run import get_args_parser

    spec = _golden_spec().model_copy(update={"grace_period_s": 12.5})
    node = _render(spec).nodes[0]
    assert not any(a.startswith("--shutdown-timeout") for a in node.argv)
    for name, value in node.env.items():
        monkeypatch.setenv(name, value)
    args = get_args_parser().parse_args(["train.py"])
    assert args.shutdown_timeout == 13  # whole seconds, rounded up
