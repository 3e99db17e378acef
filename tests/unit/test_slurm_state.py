"""How a SLURM job that accounting reports as ended did end: the outcome recorded in the job record."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gptlaunch.contract import write_stop_marker
from launcher.job.record import JobRecord, JobState, JobStatus, torchelastic_dir
from launcher.job.spec import JobSpec
from launcher.schedulers.slurm.scheduler import SlurmFacts, SlurmScheduler
from launcher.schedulers.slurm.state import AccountingInfo, SlurmHandle, end_outcome


@pytest.fixture
def record(tmp_path: Path) -> JobRecord:
    spec = JobSpec.model_validate({"nnodes": 2, "scheduler": "slurm"})
    job_dir = tmp_path / "job"
    plan = SlurmScheduler().render(spec, SlurmFacts(workdir=str(tmp_path), gpus_per_node=0), "j", job_dir)
    return JobRecord.create(job_dir, spec, plan, JobStatus(created_at=time.time() - 60))


def _error_file(record: JobRecord, node: int, message: str, when: float) -> None:
    path = torchelastic_dir(record.dir, node) / "run" / "attempt_0" / "0" / "error.json"
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


def test_error_files_of_a_run_before_a_requeue_are_not_the_root_cause(record: JobRecord) -> None:
    now = time.time()
    _error_file(record, 0, "RuntimeError: from the first run", now - 600)
    for path in torchelastic_dir(record.dir, 0).rglob("error.json"):
        os.utime(path, (now - 600, now - 600))
    _error_file(record, 1, "RuntimeError: this run", now - 5)
    outcome = end_outcome(AccountingInfo("FAILED", 1, now - 30), record)
    assert outcome.failure is not None and outcome.failure.node_rank == 1
    assert "this run" in outcome.message


def test_a_status_read_does_not_undo_the_controllers_start_recorded_meanwhile(record: JobRecord) -> None:
    # `launcher status` read "pending"; while it asked sacct, the controller recorded its start
    record.write_handle(SlurmHandle(slurm_job_id="7", submitit_folder=""))
    record.update_status(state=JobState.PENDING, message="SLURM job 7")
    started = time.time()

    class Accounting:
        def info(self, job_id: str) -> AccountingInfo:
            record.update_status(state=JobState.RUNNING, started_at=started, message="")  # the controller
            return AccountingInfo(state="RUNNING", exit_code=None, start=started - 5, job_id=job_id)

    scheduler = SlurmScheduler()
    scheduler._accounting = Accounting()  # type: ignore[assignment]
    status = scheduler.state(record)
    assert (status.state, status.started_at) == (JobState.RUNNING, started)
    assert record.status() == status


def test_submit_does_not_undo_a_start_the_controller_recorded_before_it(record: JobRecord) -> None:
    record.update_status(state=JobState.RUNNING, started_at=1.0)
    assert record.update_status(if_state=JobState.CREATED, state=JobState.PENDING).state == JobState.RUNNING
    assert record.update_status(if_state=JobState.RUNNING, message="m").message == "m"
