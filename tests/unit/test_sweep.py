"""A sweep's points and each run's arguments (``launcher.sweep.points``), the flags every run gets,
and the exit code of a sweep: every mistake named before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptlaunch.contract import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from launcher.cli.flags import UsageError
from launcher.cli.main import main
from launcher.cli.sweeps import _SWEEP_FLAGS, _max_parallel, _without
from launcher.job.record import JobState, JobStatus
from launcher.sweep import points
from launcher.sweep.points import SweepError
from launcher.sweep.record import NOT_STARTED, SUBMIT_FAILED, worst_exit_code
from trainer.precheck import train_flags


def test_a_grid_is_every_combination_the_first_key_slowest() -> None:
    found = points.grid(["lr=3e-4,1e-3", "seed=1,2,3"])
    assert found[:2] == [{"lr": "3e-4", "seed": "1"}, {"lr": "3e-4", "seed": "2"}] and len(found) == 6
    for bad, said in [
        (["lr"], "write KEY=V1,V2"),
        (["lr=1,,2"], "an empty value"),
        (["lr=1", "lr=2"], "given twice"),
        (["=1"], "write KEY=V1,V2"),
    ]:
        with pytest.raises(SweepError, match=said):
            points.grid(bad)


def test_a_sweep_file_is_a_list_of_mappings(tmp_path: Path) -> None:
    good = tmp_path / "runs.yaml"
    good.write_text("- {lr: 3e-4, seed: 1}\n- {lr: 0.001, n_layer: 4}\n")
    # YAML 1.1 reads 3e-4 (no dot) as a word: it reaches the program as written
    assert points.from_file(good) == [{"lr": "3e-4", "seed": "1"}, {"lr": "0.001", "n_layer": "4"}]
    for text, said in [("lr: 1\n", "a YAML list"), ("- {lr: }\n", "needs one value"), ("[", "cannot read")]:
        good.write_text(text)
        with pytest.raises(SweepError, match=said):
            points.from_file(good)


def test_over_a_thousand_runs_need_yes_and_none_is_refused() -> None:
    many = points.grid(["a=" + ",".join(map(str, range(40))), "b=" + ",".join(map(str, range(26)))])
    with pytest.raises(SweepError, match="1,040 runs, over 1,000: check it, then add --yes"):
        points.check_count(many, yes=False)
    points.check_count(many, yes=True)
    with pytest.raises(SweepError, match="no runs"):
        points.check_count([], yes=True)


def test_the_trainer_gets_its_own_flags_and_each_run_its_own_run_dir() -> None:
    args = ["--max-steps", "40", "--run-dir", "runs/lr/"]
    run = points.trainer_args(args, {"lr": "1e-3", "max_steps": "80"}, train_flags())
    assert run == ["--max-steps", "40", "--run-dir", "runs/lr/", "--lr", "1e-3", "--max-steps", "80"]
    assert points.run_dir_args(run, 2)[3] == "runs/lr/run-2"
    assert points.run_dir_args(["--run-dir=out"], 0) == ["--run-dir=out/run-0"]
    with pytest.raises(SweepError, match="the trainer has no flag --learning-rate"):
        points.trainer_args([], {"learning_rate": "1"}, train_flags())


def test_a_programs_placeholders_get_the_values_and_must_match_the_keys() -> None:
    args = ["train.py", "--lr={lr}", "--out", "{{run_dir}}/s{seed}"]
    run = points.program_args(args, {"lr": "3e-4", "seed": "2"})
    assert run == ["train.py", "--lr=3e-4", "--out", "{{run_dir}}/s2"]  # the Plan's own left alone
    with pytest.raises(SweepError, match=r"use \{seed\}, which no --sweep gives a value"):
        points.program_args(args, {"lr": "1"})
    with pytest.raises(SweepError, match=r"--sweep wd: no argument of the program says \{wd\}"):
        points.program_args(args, {"lr": "1", "seed": "1", "wd": "0"})


def test_each_run_gets_the_submit_flags_but_the_sweeps_own() -> None:
    given = ["--nodes", "2", "--sweep", "lr=1,2", "--sweep=seed=1", "--max-parallel", "2", "--detach",
             "--retries", "1", "--tee=all", "--yes"]  # fmt: skip
    assert _without(given, _SWEEP_FLAGS) == ["--nodes", "2", "--retries", "1"]


def test_bad_sweeps_exit_2_before_anything_is_written(tmp_path: Path, capsys) -> None:
    jobs = tmp_path / "jobs"
    for sweep, said in [
        (["--sweep", "lr="], "an empty value"),
        (["--sweep", "no_such_flag=1"], "the trainer has no flag --no-such-flag"),
        (["--sweep", "lr=1,-5"], "run 1 (lr=-5): trainer arguments"),
    ]:
        assert main(["--jobs-root", str(jobs), "submit", *sweep, "--", "--max-steps", "5"]) == 2
        assert said in capsys.readouterr().err
    assert not jobs.exists()


def _ended(state: JobState, code: int) -> tuple[str, JobStatus]:
    return str(state), JobStatus(created_at=0.0, state=state, exit_code=code)


def test_a_sweep_exits_with_its_worst_runs_code() -> None:
    ok, failed = _ended(JobState.SUCCEEDED, 0), _ended(JobState.FAILED, 1)
    assert worst_exit_code([ok, ok]) == EXIT_OK
    assert worst_exit_code([ok, _ended(JobState.CHECKPOINTED, 75), failed]) == EXIT_FAILED
    assert worst_exit_code([ok, (NOT_STARTED, None)]) == EXIT_INTERRUPTED
    assert worst_exit_code([ok, (SUBMIT_FAILED, None)]) == EXIT_FAILED


def test_runs_at_once_default_to_one_but_on_slurm_and_ssh_hosts_are_never_shared() -> None:
    assert _max_parallel(None, "local", array=False) == 1  # the machine's GPUs
    assert _max_parallel(None, "slurm", array=True) is None  # SLURM allots each task its nodes
    assert _max_parallel(3, "compose", array=False) == 3
    with pytest.raises(UsageError, match="--max-parallel 2 on SSH hosts"):
        _max_parallel(2, "ssh", array=False)


def test_a_driver_whose_runs_records_are_gone_ends(tmp_path: Path, capsys) -> None:
    """Runs' job records removed under the sweep's driver (``rm -rf`` of the record, a test's tmp
    cleanup): the driver ends instead of waiting for them for ever."""
    from launcher.sweep.drive import drive
    from launcher.sweep.record import Sweep, SweepRecord, SweepRun

    run = SweepRun(index=0, values={"lr": "1"}, job_id="gone-0", argv=[], submitted_at=1.0)
    record = SweepRecord.create(tmp_path / "s", Sweep(sweep_id="s", created_at=0.0, scheduler="local",
                                                      max_parallel=1, runs=[run]))  # fmt: skip
    drive(record)  # its one run submitted, its job record nowhere: nothing to wait for
    assert capsys.readouterr().err.splitlines() == ["launcher: sweep s: run 0 (lr=1) not started"]
