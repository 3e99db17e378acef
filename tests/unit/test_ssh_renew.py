"""The SSH transport's choice of hosts for a retry (``SshAgents.renew``), without hosts: the checks of a
submit are a stand-in ``replan`` that refuses any set of hosts holding an unusable one, so what is
proven is the choice itself: each failed host replaced by a spare of its own, in the hostfile's order."""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path

import pytest

from launcher.job.plan import Plan
from launcher.job.record import JobRecord, JobStatus
from launcher.job.spec import JobSpec, SpecError
from launcher.schedulers.ssh.agents import SshAgents
from launcher.schedulers.ssh.scheduler import SshFacts, SshScheduler

HOSTFILE = ["h1", "h2", "h3", "h4", "h5", "h6"]  # the job runs on the first NODES: the rest are spares
NODES = 3


class Checks:
    """A stand-in for ``SshScheduler.replan``: the Plan on ``hosts``, unless one is ``unusable``."""

    def __init__(self, unusable: Collection[str] = ()) -> None:
        self.unusable, self.asked = set(unusable), list[list[str]]()

    def __call__(self, spec: JobSpec, hosts: list[str], plan: Plan, job_dir: Path) -> Plan:
        self.asked.append(hosts)
        if bad := sorted(self.unusable & set(hosts)):
            raise SpecError(f"cannot check every host: {', '.join(bad)} unreachable")
        return _plan(spec, hosts, job_dir)


def _plan(spec: JobSpec, hosts: list[str], job_dir: Path) -> Plan:
    facts = SshFacts(
        workdir="/w", hosts=hosts, master_addr=hosts[0], rdzv_port=29500, ifnames={}, omp_num_threads=None
    )
    return SshScheduler().render(spec, facts, "job-1", job_dir)


def _agents(tmp_path: Path, checks: Checks, hostfile: list[str] = HOSTFILE) -> tuple[SshAgents, JobRecord]:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "hosts").write_text("\n".join(hostfile) + "\n")
    scheduler = {"kind": "ssh", "hostfile": str(tmp_path / "hosts")}
    spec = JobSpec.model_validate({"scheduler": scheduler, "nnodes": NODES, "retries": 2})
    plan = _plan(spec, hostfile[:NODES], tmp_path / "job")
    record = JobRecord.create(tmp_path / "job", spec, plan, JobStatus(created_at=time.time()))
    agents = SshAgents(plan, {}, record, replan=checks)
    return agents, record


def _hosts(plan: Plan | None) -> list[str]:
    assert plan is not None
    return [n.host for n in plan.nodes]


def test_two_failed_hosts_are_each_replaced_by_the_next_spares_in_the_hostfiles_order(tmp_path: Path) -> None:
    checks = Checks()
    agents, record = _agents(tmp_path, checks)
    # any order, a repeat and a host that is not the job's: node order decides who gets which spare
    assert _hosts(agents.renew(record, ["h3", "h1", "h3", "elsewhere"])) == ["h4", "h2", "h5"]
    assert checks.asked == [["h4", "h2", "h5"]]  # one check when the first spares are usable
    assert agents.failed == {"h1", "h3"}
    # a next retry takes neither a host that failed before (h1, h3) nor one that runs a node
    assert _hosts(agents.renew(record, ["h4"])) == ["h6", "h2", "h5"]
    assert agents.failed == {"h1", "h3", "h4"}


def test_an_unusable_spare_is_skipped_for_the_next_and_no_spare_serves_two_failed_hosts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checks = Checks(unusable={"h4"})
    agents, record = _agents(tmp_path, checks)
    assert _hosts(agents.renew(record, ["h1", "h3"])) == ["h5", "h2", "h6"]
    assert checks.asked == [["h4", "h2", "h5"], ["h4", "h2", "h6"], ["h5", "h2", "h6"]]
    err = capsys.readouterr().err
    assert "launcher: spare hosts h4, h5 cannot take over from h1, h3: cannot check every host: h4" in err


def test_too_few_usable_spares_fail_the_retry_naming_the_hosts_not_replaced(tmp_path: Path) -> None:
    checks = Checks(unusable={"h5"})
    agents, record = _agents(tmp_path, checks, HOSTFILE[:5])  # spares h4 and h5; h5 is unusable
    with pytest.raises(
        OSError, match=r"no spare host could replace h2, h3 \(2 needed\): fewer than 2 of the 2 spare"
    ):
        agents.renew(record, ["h2", "h3"])
    assert checks.asked == [["h1", "h4", "h5"]]
    agents, record = _agents(tmp_path / "2", Checks(), HOSTFILE[:4])  # one spare for two failed hosts
    with pytest.raises(
        OSError, match=r"no spare host could replace h1, h2 \(2 needed\): 1 spare host\(s\) left .*\(h4\)"
    ):
        agents.renew(record, ["h1", "h2"])


def test_a_failure_that_names_none_of_the_jobs_hosts_keeps_them(tmp_path: Path) -> None:
    checks = Checks()
    agents, record = _agents(tmp_path, checks)
    assert agents.renew(record, []) is None and agents.renew(record, ["h5"]) is None
    assert checks.asked == [] and agents.failed == set()


def test_with_no_spare_in_the_hostfile_the_retry_runs_on_the_jobs_own_hosts_again(tmp_path: Path) -> None:
    checks = Checks()
    agents, record = _agents(tmp_path, checks, HOSTFILE[:NODES])
    assert _hosts(agents.renew(record, ["h1", "h2"])) == ["h1", "h2", "h3"]  # once they answer (at once)
    assert checks.asked == [["h1", "h2", "h3"]]
