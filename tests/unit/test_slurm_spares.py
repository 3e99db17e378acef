"""SLURM hot spares (``--spare-nodes``): what is rendered, and which hosts a retry within the
allocation runs on. The retry against a real cluster: tests/integration/test_slurm_spares.py."""

from __future__ import annotations

import shlex
import stat
from pathlib import Path

import pytest

from gptlaunch.contract import ATTEMPT_ENV, FIRST_HOST_ENV
from launcher.cli.main import main
from launcher.schedulers.slurm.retry import _within, run_step
from launcher.schedulers.slurm.scheduler import SCRIPT, SUBMITIT_SCRIPT, SlurmFacts, SlurmScheduler
from launcher.schedulers.slurm.script import NO_SPARES
from tests.unit.test_slurm_render import _spec

HOSTS = ["n1", "n2", "n3", "n4"]


def _files(spares: int, retries: int = 1) -> dict[str, str]:
    spec = _spec(retries=retries, scheduler={"kind": "slurm", "spare_nodes": spares})
    facts = SlurmFacts(workdir="/work/job", gpus_per_node=0)
    return SlurmScheduler().render(spec, facts, "gold-job", Path("/jobs/gold-job")).files


def test_the_allocation_holds_the_spares_the_nodes_step_the_job_and_the_retry_step_its_srun_line() -> None:
    text = _files(spares=2)[SUBMITIT_SCRIPT]
    lines = text.splitlines()
    assert "#SBATCH --nodes=4" in lines  # 2 nodes + 2 spares
    assert "#SBATCH --no-kill" in lines  # a failed node does not end the allocation and its spares
    (probe,) = [line for line in lines if "launcher.preflight.probe" in line]
    assert "--nodes=4" in probe.split()  # a spare passes version parity before it is needed
    step = lines[lines.index("export SUBMITIT_EXECUTOR=slurm") + 1]
    assert {"--nodes=2", "--ntasks=2"} <= set(step.split()), step
    (teardown,) = [line for line in lines if "launcher.schedulers.slurm.retry" in line]
    words = shlex.split(teardown.split("&& ", 2)[2])
    assert words[words.index("--node-step") + 1] == step  # the very step submitit runs


def test_the_health_gate_runs_on_the_jobs_nodes_not_the_spares() -> None:
    spec = _spec(retries=1, scheduler={"kind": "slurm", "spare_nodes": 1, "health_check": True})
    facts = SlurmFacts(workdir="/work/job", gpus_per_node=0)
    text = SlurmScheduler().render(spec, facts, "gold-job", Path("/jobs/gold-job")).files[SUBMITIT_SCRIPT]
    (gate,) = [line for line in text.splitlines() if "/health/node-%n.out" in line]
    assert {"--nodes=2", "--ntasks=2"} <= set(gate.split()), gate
    assert 'hostnames "$SLURM_JOB_NODELIST" | head -n 2 > /jobs/gold-job/health/hosts' in text


def test_without_spares_the_nodes_step_is_the_whole_allocation_and_the_retry_step_requeues() -> None:
    text = _files(spares=0)[SUBMITIT_SCRIPT]
    assert "#SBATCH --nodes=2" in text.splitlines() and "--node-step" not in text and "--ntasks=2" not in text


def test_the_standalone_script_says_it_allocates_no_spare() -> None:
    script = _files(spares=1)[SCRIPT]
    assert NO_SPARES in script and "#SBATCH --nodes=2" in script.splitlines()
    assert "--nodes=3" not in script


def test_spares_without_retries_are_a_clear_error(tmp_path: Path, capsys) -> None:
    argv = ["--jobs-root", str(tmp_path), "render", "--scheduler", "slurm", "--spare-nodes", "1"]
    assert main(argv) == 2
    assert "--spare-nodes needs --retries N" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("ran", "avoid", "expected"),
    [
        (["n1", "n2"], {"n1"}, ("n2", "n3")),  # the failed node's place goes to the first spare
        (["n2", "n3"], {"n1", "n3"}, ("n2", "n4")),  # one excluded before is never a spare again
        (["n1", "n2"], set(), ("n1", "n2")),  # nobody to blame: the same nodes
        (["n1", "n2"], {"n1", "n2"}, ("n3", "n4")),
        (["n3", "n4"], {"n1", "n2", "n3"}, None),  # no spare left: a requeue
    ],
)
def test_a_retry_runs_on_the_survivors_and_as_many_spares_as_it_lost(
    ran: list[str], avoid: set[str], expected: tuple[str, ...] | None
) -> None:
    assert _within(HOSTS, ran, avoid) == expected


def test_the_retry_runs_the_nodes_step_on_its_hosts_as_the_next_attempt(tmp_path: Path) -> None:
    """A stand-in srun (a script that records its arguments and environment): the step gets the hosts
    as ``--nodelist``, the attempt number, and its first host as the rendezvous host."""
    srun = tmp_path / "srun"
    srun.write_text(f'#!/bin/sh\necho "$@ ${ATTEMPT_ENV} ${FIRST_HOST_ENV}" > {tmp_path}/said\nexit 3\n')
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    assert run_step([str(srun), "--nodes=2", "prog", "a b"], ("n2", "n3"), attempt=2) == 3
    assert (tmp_path / "said").read_text() == "--nodelist=n2,n3 --nodes=2 prog a b 2 n2\n"
