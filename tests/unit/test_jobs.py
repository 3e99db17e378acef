"""Job records and states, read without any process of the job: what `status`, `list` and `cancel` see."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gptlaunch.contract import EXIT_OK, EXIT_USAGE
from launcher.cli.main import main
from launcher.job.record import JobRecord, JobState, JobStatus, ProcessRef, RecordError
from launcher.job.spec import JobSpec
from launcher.schedulers.local.scheduler import LocalFacts, LocalScheduler
from launcher.supervisor import procs
from launcher.supervisor.supervisor import SupervisorHandle

FACTS = {"workdir": "/tmp", "rdzv_host": "127.0.0.1", "rdzv_port": 29555, "omp_num_threads": 1, "gpus": []}
FACTS["agent_python"] = sys.executable


def _record(
    tmp_path: Path, status: JobStatus, spec: JobSpec | None = None, job_id: str = "job-1"
) -> JobRecord:
    spec = spec or JobSpec(nnodes=2)
    plan = LocalScheduler().render(spec, LocalFacts(**FACTS), job_id, tmp_path / job_id)
    return JobRecord.create(tmp_path / job_id, spec, plan, status)


def _finished(tmp_path: Path, job_id: str = "job-1") -> JobRecord:
    now = time.time()
    status = JobStatus(state=JobState.SUCCEEDED, exit_code=0, created_at=now, started_at=now, ended_at=now)
    rec = _record(tmp_path, status, job_id=job_id)
    rec.write_handle(SupervisorHandle(scheduler="local", supervisor=_dead_process(), node_pids=[]))
    (rec.dir / "node-0.log").write_text("hello\n")
    return rec


def _add_fields(path: Path, *names: str) -> None:
    """What a newer launcher writes: the same file with fields this one does not know."""
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, **dict.fromkeys(names, 1)}))


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
    from gptlaunch.contract import write_stop_marker

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


# A record of another launcher version, or one half written: (file, what is done to it, the words).
DAMAGE: dict[str, tuple[str, Callable[[Path], object], str]] = {
    "plan-unknown-field": ("plan.json", lambda p: _add_fields(p, "from_v9"), "unknown field 'from_v9'"),
    "status-unknown-field": ("status.json", lambda p: _add_fields(p, "from_v9"), "unknown field 'from_v9'"),
    "spec-unknown-field": ("spec.json", lambda p: _add_fields(p, "from_v9"), "unknown field 'from_v9'"),
    "status-missing": ("status.json", Path.unlink, "is missing"),
    "plan-missing": ("plan.json", Path.unlink, "is missing"),
    "handle-not-json": ("handle.json", lambda p: p.write_text('{"supervisor": '), "is not valid JSON"),
}


@pytest.mark.parametrize("command", ["status", "logs", "wait", "cancel"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_record_of_another_launcher_version_is_refused_with_exit_2_naming_the_file_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, command: str
) -> None:
    rec = _finished(tmp_path)
    name, spoil, words = DAMAGE[damage]
    spoil(rec.dir / name)
    assert main(["--jobs-root", str(tmp_path), command, "job-1"]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith(f"launcher: error: {rec.dir / name} ") and words in err, err
    assert f"`rm -r {rec.dir}`" in err and err.count("\n") == 1, "one paragraph: file, problem, fix"


def test_list_shows_an_unreadable_record_as_one_row_beside_the_readable_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _finished(tmp_path, "job-1")
    _add_fields(_finished(tmp_path, "job-2").dir / "plan.json", "from_v9")
    _add_fields(_finished(tmp_path, "job-3").dir / "status.json", "from_v9")
    (_finished(tmp_path, "job-4").dir / "status.json").unlink()
    assert main(["--jobs-root", str(tmp_path), "list"]) == EXIT_OK
    out, err = capsys.readouterr()
    header, *rows = out.splitlines()
    assert header.startswith("JOB ID") and "Traceback" not in err
    assert sorted(row.split()[:2] for row in rows) == [
        ["job-1", "succeeded"],
        ["job-2", "unreadable"],
        ["job-3", "unreadable"],
        ["job-4", "unreadable"],
    ]
    reasons = err.splitlines()
    assert len(reasons) == 3, "one line on stderr per unreadable record"
    for job, words in (("job-2", "plan.json has an unknown field"), ("job-3", "status.json has an unknown")):
        assert any(f"{tmp_path / job}/{words}" in line for line in reasons), reasons
    assert any(f"{tmp_path / 'job-4'}/status.json is missing" in line for line in reasons), reasons


def test_a_record_error_says_the_first_problem_in_a_few_words_and_counts_the_rest(tmp_path: Path) -> None:
    rec = _finished(tmp_path)
    _add_fields(rec.dir / "status.json", "from_v9", "also_from_v9")
    with pytest.raises(RecordError) as refused:
        rec.status()
    message = str(refused.value)
    assert message.startswith(f"{rec.dir}/status.json has an unknown field 'from_v9' (and 1 more problem):")
    assert "\n" not in message and len(message) < 400
    (rec.dir / "status.json").write_text(json.dumps({"state": "paused", "created_at": "yesterday"}))
    with pytest.raises(RecordError, match=r"invalid field 'state' \(Input should be .* \(and 1 more problem"):
        rec.status()
    with pytest.raises(ValueError):  # what callers that skip malformed files catch, as before
        rec.status()
