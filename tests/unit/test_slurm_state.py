"""How a SLURM job that accounting reports as ended did end: the outcome recorded in the job record."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gptlaunch.contract import write_stop_marker
from launcher.job import reports
from launcher.job.record import Attempt, JobRecord, JobState, JobStatus
from launcher.job.spec import JobSpec
from launcher.schedulers.slurm.scheduler import SlurmFacts, SlurmScheduler
from launcher.schedulers.slurm.state import AccountingInfo, end_outcome


@pytest.fixture
def record(tmp_path: Path) -> JobRecord:
    spec = JobSpec.model_validate({"nnodes": 2, "scheduler": "slurm"})
    job_dir = tmp_path / "job"
    plan = SlurmScheduler().render(spec, SlurmFacts(workdir=str(tmp_path), gpus_per_node=0), "j", job_dir)
    return JobRecord.create(job_dir, spec, plan, JobStatus(created_at=time.time() - 60))


def _error_file(record: JobRecord, node: int, message: str, when: float) -> None:
    path = record.torchelastic_dir(node) / "run" / "attempt_0" / "0" / "error.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": int(when)}}}))


def test_completed_is_succeeded(record: JobRecord) -> None:
    outcome = end_outcome(AccountingInfo("COMPLETED", 0, time.time() - 30), record)
    assert (outcome.state, outcome.exit_code) == (JobState.SUCCEEDED, 0)


def test_a_stop_with_a_checkpoint_is_checkpointed_whatever_slurm_calls_it(record: JobRecord) -> None:
    run_dir = Path(record.plan().run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "ckpt.pt").write_bytes(b"")
    write_stop_marker(run_dir, 7, run_dir / "ckpt.pt", "SIGTERM")
    for word in ("CANCELLED", "FAILED", "TIMEOUT"):
        outcome = end_outcome(AccountingInfo(word, 1, time.time() - 30), record)
        assert (outcome.state, outcome.exit_code) == (JobState.CHECKPOINTED, 75)
        assert "step 7" in outcome.message


def test_a_cancel_before_any_checkpoint_is_cancelled(record: JobRecord) -> None:
    record.update_status(stop_requested_at=time.time())
    outcome = end_outcome(AccountingInfo("FAILED", 1, time.time() - 30), record)
    assert (outcome.state, outcome.exit_code) == (JobState.CANCELLED, 130)


def test_the_first_failing_node_is_named_even_without_an_error_file(record: JobRecord) -> None:
    now = time.time()
    reports.append(record.dir, reports.Failed(node=1, exit_code=-9, time=now - 5))
    reports.append(record.dir, reports.Failed(node=0, exit_code=1, time=now - 2))
    outcome = end_outcome(AccountingInfo("FAILED", 1, now - 30), record)
    assert outcome.state == JobState.FAILED and outcome.failure is not None
    assert outcome.failure.node_rank == 1 and "node 1" in outcome.message and "-9" in outcome.message


def test_error_files_of_a_run_before_a_requeue_are_not_the_root_cause(record: JobRecord) -> None:
    now = time.time()
    _error_file(record, 0, "RuntimeError: from the first run", now - 600)
    for path in record.torchelastic_dir(0).rglob("error.json"):
        os.utime(path, (now - 600, now - 600))
    _error_file(record, 1, "RuntimeError: this run", now - 5)
    outcome = end_outcome(AccountingInfo("FAILED", 1, now - 30), record)
    assert outcome.failure is not None and outcome.failure.node_rank == 1
    assert "this run" in outcome.message


def test_a_task_that_died_is_a_failure_of_its_node_even_if_the_others_then_checkpointed(
    record: JobRecord,
) -> None:
    """srun ends the other tasks with SIGTERM when one dies (their ranks checkpoint and stop): the run
    failed on the node whose task started in this run and never ended (an earlier run's aside);
    when every task that started ended, the same stop is a checkpoint."""
    run_dir = Path(record.plan().run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "ckpt.pt").write_bytes(b"")
    write_stop_marker(run_dir, 7, run_dir / "ckpt.pt", "SIGTERM")
    now = time.time()
    sent = [
        reports.Started(node=0, host="n1", time=now - 600),  # an earlier run: its task died too
        reports.Started(node=0, host="n2", time=now - 20),
        reports.Started(node=1, host="n3", time=now - 20),
        reports.Ended(node=0, exit_code=75, time=now - 5),  # stopped by srun's SIGTERM
    ]
    for report in sent:
        reports.append(record.dir, report)
    outcome = end_outcome(AccountingInfo("FAILED", 1, now - 30, job_id="42"), record)
    assert outcome.state == JobState.FAILED and outcome.failure is not None, outcome
    assert (outcome.failure.node_rank, outcome.failure.host) == (1, "n3"), outcome
    assert "without a word" in outcome.message, outcome.message
    reports.append(record.dir, reports.Ended(node=1, exit_code=0, time=now - 4))
    outcome = end_outcome(AccountingInfo("FAILED", 75, now - 30, job_id="42"), record)
    assert outcome.state == JobState.CHECKPOINTED, outcome


def test_an_attempt_on_spare_nodes_is_judged_by_its_own_reports_not_the_allocations(
    record: JobRecord,
) -> None:
    """A retry on spare nodes (``--spare-nodes``) runs in the allocation that ran the attempt before
    it: that attempt's failed node and stop marker (its survivors checkpointed) are not this one's."""
    run_dir = Path(record.plan().run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "ckpt.pt").write_bytes(b"")
    reports.append(record.dir, reports.Failed(node=0, exit_code=1, time=time.time()))  # attempt 1
    write_stop_marker(run_dir, 13, run_dir / "ckpt.pt", "SIGTERM")  # attempt 1's survivors
    ended = time.time()
    first = Attempt(number=1, started_at=ended - 60, ended_at=ended, exit_code=1, cause="node 0 failed")
    record.update_status(attempts=[first], attempt=2)
    reports.append(record.dir, reports.Failed(node=1, exit_code=1, time=ended + 1))  # attempt 2
    since = ended - 60  # the allocation's start
    outcome = end_outcome(AccountingInfo("FAILED", 1, since, job_id="42"), record)
    assert outcome.state == JobState.FAILED and outcome.failure is not None, outcome
    assert outcome.failure.node_rank == 1, outcome
