"""Job records and states, read without any process of the job: what `status`, `list` and `cancel` see."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.job.record import JobRecord, JobState, JobStatus, ProcessRef
from launcher.job.spec import JobSpec
from launcher.schedulers.local.scheduler import LocalFacts, LocalScheduler
from launcher.supervisor import procs
from launcher.supervisor.supervisor import SupervisorHandle

FACTS = {"workdir": "/tmp", "rdzv_host": "127.0.0.1", "rdzv_port": 29555, "omp_num_threads": 1, "gpus": []}


def _record(tmp_path: Path, status: JobStatus, spec: JobSpec | None = None) -> JobRecord:
    spec = spec or JobSpec(nnodes=2)
    plan = LocalScheduler().render(spec, LocalFacts(**FACTS), "job-1", tmp_path / "job-1")
    return JobRecord.create(tmp_path / "job-1", spec, plan, status)


def _dead_process() -> ProcessRef:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    ref = procs.process_ref(proc.pid)
    proc.wait()
    return ref


def test_only_pending_created_and_running_are_not_terminal() -> None:
    assert {s for s in JobState if not s.is_terminal} == {
        JobState.CREATED,
        JobState.PENDING,
        JobState.RUNNING,
    }
    for state in ("succeeded", "failed", "checkpointed", "cancelled", "lost", "unknown"):
        assert JobState(state).is_terminal


def test_spec_json_holds_what_the_user_asked_for(tmp_path: Path) -> None:
    _record(tmp_path, JobStatus(created_at=time.time()), JobSpec(nnodes=2, trainer_args=["--max-steps", "3"]))
    assert json.loads((tmp_path / "job-1" / "spec.json").read_text()) == {
        "nnodes": 2,
        "trainer_args": ["--max-steps", "3"],
    }
    assert json.loads((tmp_path / "job-1" / "plan.json").read_text())["facts"]["rdzv_port"] == 29555


def test_a_created_job_whose_submitter_died_is_lost(tmp_path: Path) -> None:
    rec = _record(tmp_path, JobStatus(created_at=time.time(), submitter=_dead_process()))
    status = LocalScheduler().state(rec)
    assert status.state == JobState.LOST and status.job_exit_code == 1
    assert rec.status().state == JobState.LOST, "a derived end is recorded, so it never changes again"


def test_a_created_job_whose_submitter_lives_stays_created(tmp_path: Path) -> None:
    rec = _record(tmp_path, JobStatus(created_at=time.time(), submitter=procs.process_ref()))
    assert LocalScheduler().state(rec).state == JobState.CREATED


def test_a_running_job_whose_supervisor_died_after_a_stop_checkpoint_is_checkpointed(tmp_path: Path) -> None:
    from trainer.contract import write_stop_marker

    started = time.time()
    rec = _record(tmp_path, JobStatus(state=JobState.RUNNING, created_at=started, started_at=started))
    rec.write_handle(SupervisorHandle(scheduler="local", supervisor=_dead_process(), node_pids=[]))
    run_dir = Path(rec.plan().run_dir)
    run_dir.mkdir(parents=True)
    write_stop_marker(run_dir, 7, run_dir / "ckpt-00000007.pt")
    status = LocalScheduler().state(rec)
    assert status.state == JobState.CHECKPOINTED and status.job_exit_code == 75 and "step 7" in status.message


def test_cancelling_a_job_that_never_started_records_no_start_time(tmp_path: Path) -> None:
    created = time.time()
    # A live submitter that has not started the job yet: cancel itself records the end.
    rec = _record(tmp_path, JobStatus(created_at=created, submitter=procs.process_ref()))
    status = LocalScheduler().cancel(rec)
    assert status.state == JobState.CANCELLED and status.started_at is None
    assert status.created_at == pytest.approx(created) and status.ended_at is not None
    assert status.ended_at >= created


def test_status_of_a_finished_job_imports_no_torch_and_answers_fast(tmp_path: Path) -> None:
    now = time.time()
    rec = _record(tmp_path, JobStatus(state=JobState.SUCCEEDED, exit_code=0, created_at=now, started_at=now))
    (rec.dir / "node-0.log").write_text("hello\n")
    probe = (
        "import sys; from launcher.cli.main import main\n"
        "cmds = [['list'], ['status', 'job-1'], ['logs', '-f', 'job-1'], ['wait', 'job-1'],\n"
        "        ['cancel', 'job-1']]\n"
        "for cmd in cmds:\n"
        f"    assert main(['--jobs-root', {str(tmp_path)!r}, *cmd]) == 0, cmd\n"
        "heavy = [m for m in ('torch', 'numpy', 'tokenizers', 'datasets') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "node0 | hello" in out.stdout and "succeeded" in out.stdout


def test_the_spec_loads_only_options_models_and_every_registered_scheduler_has_a_class() -> None:
    probe = (
        "import sys, launcher.job.spec; print(sorted(m for m in sys.modules if m.startswith('launcher.')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = [m for m in eval(out.stdout) if m.startswith("launcher.schedulers.")]
    assert loaded and not [m for m in loaded if m.endswith(".scheduler")], loaded
    from launcher.job.registry import scheduler_kinds
    from launcher.schedulers import get_scheduler

    assert {"local", "slurm", "ssh", "compose"} <= set(scheduler_kinds())
    assert [get_scheduler(kind).name for kind in scheduler_kinds()] == scheduler_kinds()


def test_options_of_a_scheduler_are_checked_by_that_schedulers_model() -> None:
    from pydantic import ValidationError

    assert JobSpec.model_validate({"scheduler": "local"}).scheduler.kind == "local"
    with pytest.raises(ValidationError, match="partition"):
        JobSpec.model_validate({"scheduler": {"kind": "local", "partition": "gpu"}})
    with pytest.raises(ValidationError, match="'k8s' is not available"):
        JobSpec.model_validate({"scheduler": {"kind": "k8s"}})


def test_a_recorded_end_is_never_replaced(tmp_path: Path) -> None:
    from launcher.job.record import Outcome

    rec = _record(tmp_path, JobStatus(created_at=time.time()))
    rec.finish(Outcome(state=JobState.CANCELLED, exit_code=130))
    # e.g. a supervisor that started the nodes just after `launcher cancel` recorded the end
    assert rec.update_status(state=JobState.RUNNING, started_at=time.time()).state == JobState.CANCELLED
    assert rec.finish(Outcome(state=JobState.SUCCEEDED, exit_code=0)).state == JobState.CANCELLED
    assert rec.status().state == JobState.CANCELLED and rec.status().started_at is None
