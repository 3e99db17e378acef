"""SLURM hot spares (``--spare-nodes``): what is rendered, and which hosts a retry within the
allocation runs on (``launcher.schedulers.slurm.transport.on_spares``). The retry against a real
cluster: tests/integration/test_slurm_spares.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli.main import main
from launcher.schedulers.slurm.scheduler import SCRIPT, SUBMITIT_SCRIPT, SlurmFacts, SlurmScheduler
from launcher.schedulers.slurm.transport import on_spares
from launcher.supervisor.transport import NewAllocation
from tests.unit.test_slurm_render import _spec

HOSTS = ["n1", "n2", "n3", "n4"]


def _files(spares: int, retries: int = 1) -> dict[str, str]:
    spec = _spec(retries=retries, scheduler={"kind": "slurm", "spare_nodes": spares})
    facts = SlurmFacts(workdir="/work/job", gpus_per_node=0)
    return SlurmScheduler().render(spec, facts, "gold-job", Path("/jobs/gold-job")).files


def test_the_allocation_holds_the_spares_and_the_controller_runs_in_its_batch_step() -> None:
    text = _files(spares=2)[SUBMITIT_SCRIPT]
    lines = text.splitlines()
    assert "#SBATCH --nodes=4" in lines  # 2 nodes + 2 spares
    assert "#SBATCH --no-kill" in lines  # a failed node does not end the allocation and its spares
    (probe,) = [line for line in lines if "launcher.preflight.probe" in line]
    assert "--nodes=4" in probe.split()  # a spare passes version parity before it is needed
    command = lines[lines.index("export SUBMITIT_EXECUTOR=slurm") + 1]
    assert command.split()[1:4] == ["-u", "-m", "submitit.core._submit"], command  # no srun: one task
    assert "teardown" not in text


def test_the_health_gate_runs_on_the_jobs_nodes_not_the_spares() -> None:
    spec = _spec(retries=1, scheduler={"kind": "slurm", "spare_nodes": 1, "health_check": True})
    facts = SlurmFacts(workdir="/work/job", gpus_per_node=0)
    text = SlurmScheduler().render(spec, facts, "gold-job", Path("/jobs/gold-job")).files[SUBMITIT_SCRIPT]
    (gate,) = [line for line in text.splitlines() if "/health/node-%n.out" in line]
    assert {"--nodes=2", "--ntasks=2"} <= set(gate.split()), gate
    assert 'hostnames "$SLURM_JOB_NODELIST" | head -n 2 > /jobs/gold-job/health/hosts' in text


def test_the_standalone_script_allocates_the_spares_too() -> None:
    lines = _files(spares=1)[SCRIPT].splitlines()
    assert "#SBATCH --nodes=3" in lines and "#SBATCH --no-kill" in lines


def test_spares_without_retries_are_a_clear_error(tmp_path: Path, capsys) -> None:
    argv = ["--jobs-root", str(tmp_path), "render", "--scheduler", "slurm", "--spare-nodes", "1"]
    assert main(argv) == 2
    assert "--spare-nodes needs --retries N" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("current", "failed", "expected"),
    [
        (["n1", "n2"], {"n1"}, ["n3", "n2"]),  # the failed node's place (node 0) goes to the first spare
        (["n2", "n3"], {"n1", "n3"}, ["n2", "n4"]),  # one that failed before is never a spare again
        (["n1", "n2"], set(), ["n1", "n2"]),  # nobody to blame: the same nodes
        (["n1", "n2"], {"n1", "n2"}, ["n3", "n4"]),
    ],
)
def test_a_retry_runs_on_the_survivors_and_as_many_spares_as_it_lost(
    current: list[str], failed: set[str], expected: list[str]
) -> None:
    assert on_spares(HOSTS, current, failed) == expected


def test_with_no_spare_left_the_next_attempt_needs_a_new_allocation() -> None:
    with pytest.raises(NewAllocation, match="no spare node left in the allocation for n3"):
        on_spares(HOSTS, ["n3", "n4"], {"n1", "n2", "n3"})
