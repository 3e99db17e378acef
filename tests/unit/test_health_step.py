"""The health gate inside a SLURM job (``launcher.preflight.health_step``,
``launcher.schedulers.slurm.steps.gate_lines``): the judgment of the workers' output, what it records for the
job's end and its retry, and the batch script's lines run by bash with `srun` and `scontrol`
stand-ins that write what the real ones would."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gptlaunch.contract import EXIT_REFUSED, EXIT_USAGE
from launcher.job import reports
from launcher.job.measurements import CollectiveError, CollectiveResult, DeviceResult
from launcher.job.record import JobState, Outcome
from launcher.job.retry import refusal
from launcher.job.spec import JobSpec
from launcher.preflight.health_step import HEALTH_DIR, HOSTS, main
from launcher.schedulers.slurm.scheduler import BATCH_SETUP
from launcher.schedulers.slurm.steps import gate_lines

NODES = ["n1", "n2", "n3"]


def _result(tflops: list[float]) -> CollectiveResult:
    """Rank 0's result with one CPU device per node at ``tflops``."""
    compute = [
        DeviceResult(
            rank=k, node=k, local_rank=0, device="cpu", kind="cpu", dtype="float32", size=256, tflops=t
        )
        for k, t in enumerate(tflops)
    ]
    return CollectiveResult(
        backend="gloo", world_size=len(tflops), hosts=["vm"], ifname={}, master="n1:15001", torch="2.13.0",
        iters=5, warmup=2, init_s=0.1, results=[], compute=compute,
    )  # fmt: skip


def _done(tflops: list[float]) -> reports.CollectiveDone:
    return reports.CollectiveDone(node=0, rank=0, result=_result(tflops))


def _job_dir(tmp_path: Path, *sent: reports.NodeReport, hosts: list[str] | None = NODES) -> Path:
    """A job directory whose gate workers sent ``sent`` (each rank into its own file, as they do)."""
    health = tmp_path / HEALTH_DIR
    health.mkdir(parents=True)
    (health / "node-0.out").write_text("[rank0]: torchrun's output, for people\n")
    for report in sent:
        assert isinstance(report, reports.CollectiveDone | reports.CollectiveFailed)
        reports.append_to(health, f"rank-{report.rank}", report)
    if hosts is not None:
        (health / HOSTS).write_text("\n".join(hosts) + "\n")
    return tmp_path


def test_a_slow_node_ends_the_job_with_exit_3_naming_it_for_the_retry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_dir = _job_dir(tmp_path, _done([0.1, 0.02, 0.1]))
    assert main(["--job-dir", str(job_dir), "--nodes", "3"]) == EXIT_REFUSED
    out, err = capsys.readouterr()
    assert "health gate: 1 host(s) named:\nn2: compute 0.02 TFLOP/s on cpu (rank 1, float32)" in out
    assert err.startswith("the health gate named 1 node(s):\n  n2: compute 0.02 TFLOP/s")
    (failure,) = reports.read(job_dir, reports.Refused)
    assert (failure.check, failure.exit_code, failure.nodes) == ("health", EXIT_REFUSED, [1])
    outcome = Outcome(
        state=JobState.FAILED, exit_code=3, message=failure.message, suspect_nodes=failure.nodes
    )
    assert outcome.blamed_nodes() == [1]
    assert refusal(outcome, None, [], retries=1) is None  # retried, without n2
    parity = outcome.model_copy(update={"suspect_nodes": []})  # a parity refusal names no node
    assert refusal(parity, None, [], retries=1) == "the nodes were refused before training"


def test_warn_reports_the_named_node_and_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_dir = _job_dir(tmp_path, _done([0.1, 0.1, 0.02]), hosts=None)
    assert main(["--job-dir", str(job_dir), "--nodes", "3", "--warn"]) == 0
    out = capsys.readouterr().out
    assert "\nnode 2: compute 0.02 TFLOP/s" in out  # no hosts file: node ranks name the nodes
    assert "WARNING: --health-check-warn: training although the health gate named" in out
    assert not reports.read(job_dir, reports.Refused)


def test_healthy_nodes_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_dir = _job_dir(tmp_path, _done([0.1, 0.09, 0.1]))
    assert main(["--job-dir", str(job_dir), "--nodes", "3"]) == 0
    assert "health gate: no host named (3 host(s); compute checked)" in capsys.readouterr().out
    assert not reports.read(job_dir, reports.Refused)


def test_a_gate_that_could_not_run_fails_the_job_with_the_ranks_errors(tmp_path: Path) -> None:
    error = CollectiveError(
        rank=1, host="n2", backend="gloo", ifname={}, master="n1:1", phase="init",
        message="collective preflight failed on rank 1 of 2 on n2: could not form the group",
    )  # fmt: skip
    job_dir = _job_dir(tmp_path, reports.CollectiveFailed(node=1, rank=1, error=error))
    assert main(["--job-dir", str(job_dir), "--nodes", "2"]) == EXIT_USAGE  # not a node to retry without
    (failure,) = reports.read(job_dir, reports.Refused)
    assert failure.nodes == []
    assert failure.message.startswith("health gate: the collective preflight failed:\n  collective preflight")


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _spec(**scheduler: object) -> JobSpec:
    fields = {
        "nnodes": 2,
        "python": sys.executable,
        "retries": 1,
        "scheduler": {"kind": "slurm", **scheduler},
    }
    return JobSpec.model_validate(fields)


@pytest.mark.parametrize("retries", [False, True])
def test_the_batch_lines_end_the_job_or_leave_the_named_node_to_the_controller(
    retries: bool, tmp_path: Path
) -> None:
    """The gate's lines as submitit's batch script runs them, by bash: `srun` puts rank 0's report (n2
    slow) beside the step's --output; the real judgment names n2 in a refusal report. Without
    retries the script exits 3; with them it goes on to the controller, which retries without n2."""
    job_dir, bin_dir = tmp_path / "job", tmp_path / "bin"
    bin_dir.mkdir()
    result = tmp_path / "rank-0.jsonl"
    result.write_bytes(reports.encode(_done([0.1, 0.02])))
    _fake(bin_dir, "scontrol", 'echo n1; echo n2  # show hostnames "$SLURM_JOB_NODELIST"')
    srun = 'for a in "$@"; do case $a in --output=*) out=${a#--output=};; esac; done\n'
    srun += f'cp {result} "$(dirname "$out")"; echo "$@" > {tmp_path}/srun.args'
    _fake(bin_dir, "srun", srun)
    spec = _spec(health_check=True)
    env_nodes = {"GLOO_SOCKET_IFNAME": "{{ifname}}"}
    lines = gate_lines(spec, os.getcwd(), job_dir, env_nodes, None, carry_on=retries)
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[1-2]"}
    script = "\n".join([*BATCH_SETUP, *lines, "echo controller"])
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == (0 if retries else EXIT_REFUSED), proc.stdout + proc.stderr
    assert "n2: compute 0.02 TFLOP/s" in proc.stdout, proc.stdout
    assert ("controller" in proc.stdout.splitlines()) == retries, proc.stdout
    (refused,) = reports.read(job_dir, reports.Refused, 0.0)
    assert (refused.exit_code, refused.nodes) == (EXIT_REFUSED, [1])  # what the controller reads
    assert (job_dir / HEALTH_DIR / HOSTS).read_text() == "n1\nn2\n"
    args = (tmp_path / "srun.args").read_text()
    # The environment before the node entry (which fills in placeholders in its argv only), as for training.
    reports_to = f"GPTLAUNCH_REPORT_DIR={job_dir / HEALTH_DIR}"  # where the workers report
    assert (
        f"env GLOO_SOCKET_IFNAME={{{{ifname}}}} {reports_to} {sys.executable} -m launcher.job.node " in args
    )
    assert "--node-rank={{node_rank}}" in args
    assert "-m launcher.preflight.collective --timeout-s=60 --compute-s=1 " in args
    assert gate_lines(_spec(), "/", job_dir, {}, None) == []  # no --health-check, no gate
