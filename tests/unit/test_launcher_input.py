"""Bad input to `launcher submit`: a clear message naming the field, exit code 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli.main import main
from launcher.job.spec import JobSpec


@pytest.fixture()
def jobs_root(tmp_path: Path) -> Path:
    return tmp_path / "jobs"


def _submit(jobs_root: Path, *args: str) -> int:
    return main(["--jobs-root", str(jobs_root), "submit", *args])


def _assert_rejected(code: int, capsys, jobs_root: Path, *needles: str) -> None:
    err = capsys.readouterr().err
    assert code == 2, err
    for needle in needles:
        assert needle in err, err
    assert not jobs_root.exists(), "a rejected job must write nothing"


def test_unknown_config_field(tmp_path: Path, jobs_root: Path, capsys) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("nnodes: 2\nrendezvous:\n  prot: 29500\n")
    _assert_rejected(
        _submit(jobs_root, "--config", str(cfg)), capsys, jobs_root, "rendezvous.prot", "spelling"
    )


def test_config_file_that_is_missing_or_not_yaml(tmp_path: Path, jobs_root: Path, capsys) -> None:
    _assert_rejected(
        _submit(jobs_root, "--config", str(tmp_path / "none.yaml")), capsys, jobs_root, "--config"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("nnodes: [1,\n")
    _assert_rejected(_submit(jobs_root, "--config", str(bad)), capsys, jobs_root, "not valid YAML")


def test_zero_nodes(jobs_root: Path, capsys) -> None:
    _assert_rejected(
        _submit(jobs_root, "--nodes", "0"), capsys, jobs_root, "nnodes (--nodes)", "greater than"
    )


def test_unknown_scheduler(jobs_root: Path, capsys) -> None:
    _assert_rejected(
        _submit(jobs_root, "--scheduler", "k8s"), capsys, jobs_root, "'k8s' is not available", "local"
    )


def test_negative_steps(jobs_root: Path, capsys) -> None:
    _assert_rejected(_submit(jobs_root, "--", "--max-steps", "-3"), capsys, jobs_root, "--max-steps")


def test_missing_data_file(tmp_path: Path, jobs_root: Path, capsys) -> None:
    code = _submit(jobs_root, "--", "--text-files", str(tmp_path / "missing.txt"))
    _assert_rejected(code, capsys, jobs_root, "missing.txt", "not found")


def test_empty_text_file(tmp_path: Path, jobs_root: Path, capsys) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    _assert_rejected(_submit(jobs_root, "--", "--text-files", str(empty)), capsys, jobs_root, "empty")


def test_vocab_that_does_not_fit_the_token_dtype(jobs_root: Path, capsys) -> None:
    code = _submit(jobs_root, "--", "--vocab-size", "70000", "--token-dtype", "uint16")
    _assert_rejected(code, capsys, jobs_root, "--vocab-size 70000", "uint16")


def test_global_batch_that_does_not_split_over_the_world(jobs_root: Path, capsys) -> None:
    code = _submit(jobs_root, "--nodes", "2", "--", "--global-batch-tokens", "1000")
    _assert_rejected(code, capsys, jobs_root, "--global-batch-tokens", "multiple of")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--", "--run-dir", "runs/a\nb"], "control character"),
        (["--env", "KEY=line1\nline2"], "control character"),
        (["--env", "1BAD=x"], "not a valid environment variable name"),
        (["--env", "NOEQUALS"], "KEY=VALUE"),
        (["--workdir", "/tmp/a\x00b"], "control character"),
        (["--nccl-socket-ifname", "eth0; rm -rf /"], "interface name"),
        (["--env", "RANK=3"], "set by the launcher or torchrun"),
        (["--env", "GPTLAUNCH_JOB_ID=other"], "set by the launcher or torchrun"),
        (["--", "--run-dir", "runs/\u202etxt.exe"], "control character"),
        (["--", "--run", "runs/x"], "unrecognized arguments: --run"),  # no abbreviations of --run-dir
        (["--python", "/no/such/python"], "--python"),
        (["--workdir", "/no/such/dir"], "--workdir"),
        (["--rdzv-endpoint", "192.0.2.1"], "not an address of this machine"),
        (["--", "--stop-signals", "SIGKILL"], "cannot be a stop signal"),
    ],
)
def test_control_characters_and_malformed_values_are_rejected(args, needle, jobs_root: Path, capsys) -> None:
    _assert_rejected(_submit(jobs_root, *args), capsys, jobs_root, needle)


def test_dry_run_prints_the_plan_and_writes_nothing(jobs_root: Path, capsys) -> None:
    import json

    assert _submit(jobs_root, "--nodes", "2", "--dry-run", "--json", "--", "--max-steps", "5") == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["nnodes"] == 2 and len(plan["nodes"]) == 2
    assert plan["nodes"][0]["argv"][-4:] == ["--max-steps", "5", "--run-dir", plan["run_dir"]]
    assert not jobs_root.exists()


def test_render_is_the_same_as_dry_run(jobs_root: Path, capsys) -> None:
    import re

    args = ["--nodes", "2", "--rdzv-port", "29511", "--omp-num-threads", "1", "--", "--max-steps", "3"]
    assert main(["--jobs-root", str(jobs_root), "render", *args]) == 0
    rendered = capsys.readouterr().out
    assert main(["--jobs-root", str(jobs_root), "submit", "--dry-run", *args]) == 0
    dry_run = capsys.readouterr().out

    def same_job_id(text: str) -> str:
        return re.sub(r"gpt-\d{8}-\d{6}-[0-9a-f]{6}", "JOB", text)

    assert same_job_id(rendered) == same_job_id(dry_run)
    assert not jobs_root.exists(), "neither may create a job record"
    assert rendered.count("torch.distributed.run") == 2 and "--rdzv-endpoint=127.0.0.1:29511" in rendered


def test_the_example_job_config_renders(jobs_root: Path, capsys, monkeypatch) -> None:
    import json

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)  # as from a fresh clone: it names no file outside the repository
    code = main(["--jobs-root", str(jobs_root), "render", "--config", "deploy/examples/job.yaml", "--json"])
    assert code == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert plan["nnodes"] == 2 and plan["nodes"][1]["env"]["NCCL_IB_DISABLE"] == "1"
    assert "../" not in (repo / "deploy" / "examples" / "job.yaml").read_text()


def test_relative_trainer_paths_are_checked_in_the_workdir(tmp_path: Path, jobs_root: Path, capsys) -> None:
    import json

    (tmp_path / "corpus.txt").write_text("some text\n")
    args = ["--workdir", str(tmp_path), "--dry-run", "--json", "--", "--text-files", "corpus.txt"]
    assert _submit(jobs_root, *args) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert plan["run_dir"].startswith(str(jobs_root.absolute()))  # absolute, whatever the cwd
    assert _submit(jobs_root, "--dry-run", "--", "--text-files", "corpus.txt") == 2  # not in this cwd


def test_a_setting_given_twice_is_refused_not_silently_overridden(jobs_root: Path, capsys) -> None:
    code = _submit(jobs_root, "--omp-num-threads", "2", "--env", "OMP_NUM_THREADS=3")
    _assert_rejected(code, capsys, jobs_root, "OMP_NUM_THREADS is set twice")


def test_a_bug_in_the_trainer_check_is_not_reported_as_invalid_input(jobs_root: Path, monkeypatch) -> None:
    import trainer.precheck

    def broken(*args, **kwargs):
        raise ValueError("a bug, not a user mistake")

    monkeypatch.setattr(trainer.precheck, "check_train_args", broken)
    with pytest.raises(ValueError, match="a bug"):
        _submit(jobs_root, "--dry-run")


def test_data_paths_are_checked_only_where_the_nodes_see_this_machines_files(tmp_path: Path) -> None:
    from launcher.cli.flags import UsageError
    from launcher.cli.submit import check_trainer_args

    spec = JobSpec(trainer_args=["--text-files", "/only/on/the/cluster.txt"])
    check_trainer_args(spec, tmp_path, files_here=False)  # a SLURM or SSH job: not refused here
    with pytest.raises(UsageError, match=r"cluster\.txt"):
        check_trainer_args(spec, tmp_path, files_here=True)
    with pytest.raises(UsageError, match="--global-batch-tokens"):  # the other checks still run
        bad = JobSpec(nnodes=2, trainer_args=["--global-batch-tokens", "1000"])
        check_trainer_args(bad, tmp_path, files_here=False)


def test_an_unwritable_jobs_root_is_a_clear_error(tmp_path: Path, capsys) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    code = _submit(blocked / "jobs", "--", "--max-steps", "1")
    err = capsys.readouterr().err
    assert code == 2 and "cannot write the job record" in err and "--jobs-root" in err, err


def test_the_launcher_raises_its_open_files_limit_to_the_hard_limit() -> None:
    """A thousand hosts need more descriptors than the usual soft limit of 1,024."""
    code = (
        "import resource; from launcher.cli.main import allow_many_open_files as a; "
        "print(a(), resource.getrlimit(resource.RLIMIT_NOFILE)[1])"
    )
    proc = subprocess.run(
        ["bash", "-c", f'ulimit -Sn 256 && "{sys.executable}" -c "{code}"'], capture_output=True, text=True
    )
    soft, hard = proc.stdout.split()
    assert proc.returncode == 0 and soft == hard != "256", proc.stderr


@pytest.mark.parametrize(
    "args, hint",
    [
        (["-N", "2"], "-N: did you mean --nodes?"),  # SLURM's
        (["--job-name", "x"], "--job-name: did you mean --name?"),
        (["--nodse", "2"], "--nodse: did you mean --nodes?"),  # a near-miss
        (["--rdzv_endpoint", "h:1"], "--rdzv_endpoint: did you mean --rdzv-endpoint?"),  # torchrun's `_`
        (["--master-addr", "h"], "--master-addr: did you mean --rdzv-endpoint?"),
        (
            ["--max-steps", "5", "--lr", "1e-3"],
            "go after --: launcher submit [options] -- --max-steps 5 --lr 1e-3",
        ),
        (["train.py", "--epochs", "3"], "go after --: launcher submit [options] -- train.py --epochs 3"),
        (["--jobs-root", "j"], "--jobs-root goes before the command: launcher --jobs-root ... submit ..."),
    ],
)
def test_unknown_arguments_name_the_flag_meant_or_where_they_go(args, hint, jobs_root: Path, capsys) -> None:
    _assert_rejected(
        _submit(jobs_root, "--dry-run", *args), capsys, jobs_root, "unrecognized arguments:", hint
    )


def test_torchruns_spellings_of_nodes_and_processes_are_accepted(jobs_root: Path, capsys) -> None:
    import json

    for args in (["--nnodes", "2", "--nproc_per_node", "3"], ["--nodes", "2", "--nproc-per-node", "3"]):
        assert _submit(jobs_root, "--dry-run", "--json", *args) == 0
        plan = json.loads(capsys.readouterr().out)
        assert (plan["nnodes"], plan["nproc_per_node"]) == (2, 3)


def test_a_dry_run_refuses_what_the_submit_would(tmp_path: Path, jobs_root: Path, capsys) -> None:
    _assert_rejected(_submit(jobs_root, "--dry-run", "--detach", "--wait"), capsys, jobs_root, "contradict")
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    code = _submit(jobs_root, "--dry-run", "--job-dir", str(used))
    _assert_rejected(code, capsys, jobs_root, f"{used} already holds files: choose another --job-dir")
    assert sorted(p.name for p in used.iterdir()) == ["notes.txt"]  # nothing written, nothing removed


@pytest.mark.parametrize("scheduler", ["slurm", "ssh", "compose"])
def test_the_loopback_interface_is_refused_where_nodes_are_on_other_machines(
    scheduler: str, jobs_root: Path, capsys
) -> None:
    args = ["--scheduler", scheduler, "--nodes", "2", "--gloo-socket-ifname", "lo", "--dry-run"]
    args += {"ssh": ["--hosts", "a,b"], "compose": ["--image", "gptlaunch:cpu"]}.get(scheduler, [])
    code = _submit(jobs_root, *args)
    _assert_rejected(
        code, capsys, jobs_root, "--gloo-socket-ifname lo: the loopback interface reaches no other"
    )


def test_the_loopback_interface_is_fine_for_one_node_or_the_local_scheduler(jobs_root: Path, capsys) -> None:
    assert _submit(jobs_root, "--nodes", "2", "--gloo-socket-ifname", "lo", "--dry-run") == 0
    one = ["--scheduler", "slurm", "--nodes", "1", "--nccl-socket-ifname", "lo", "--dry-run"]
    assert _submit(jobs_root, *one) == 0, capsys.readouterr().err
    apart = ["--scheduler", "slurm", "--nodes", "2", "--nccl-socket-ifname", "^docker,lo", "--dry-run"]
    assert _submit(jobs_root, *apart) == 0, capsys.readouterr().err  # an exclusion, not the loopback


def test_config_fields_are_listed_beside_their_flags() -> None:
    """A config file's field names differ from some flags (``nnodes``/``--nodes``,
    ``scheduler.sbatch``/``--slurm-opt``): --help shows both side by side."""
    from launcher.cli.fields import describe_fields

    flags = {(name, flag) for name, flag, _ in describe_fields()}
    pairs = [
        ("nnodes", "--nodes"),
        ("scheduler.sbatch", "--slurm-opt"),
        ("scheduler.gpus", "--slurm-gpus"),
        ("scheduler.max_parallel", "--ssh-max-parallel"),
        ("rendezvous.port", "--rdzv-port"),
    ]
    assert [pair for pair in pairs if pair not in flags] == []


def _help(*args: str, capsys) -> str:
    with pytest.raises(SystemExit) as ended:
        main(["submit", *args, "--help"])
    assert ended.value.code == 0
    return str(capsys.readouterr().out)


def test_submit_help_shows_the_common_flags_and_a_schedulers_own_when_named(capsys) -> None:
    common = _help(capsys=capsys)
    assert "--nodes" in common and "--partition" not in common and "--hostfile" not in common
    assert "launcher submit --scheduler NAME --help (local, compose, slurm, ssh)" in common
    slurm = _help("--scheduler", "slurm", capsys=capsys)
    assert "--partition" in slurm and "scheduler.partition" in slurm and "--nodes" in slurm
    assert "--hostfile" not in slurm and "scheduler.hostfile" not in slurm
    ssh = _help("--scheduler=ssh", capsys=capsys)
    assert "--hostfile" in ssh and "--partition" not in ssh
    assert len(common.splitlines()) < len(slurm.splitlines())


def test_a_schedulers_flag_is_accepted_whatever_help_shows(jobs_root: Path, tmp_path: Path, capsys) -> None:
    """Help lists a scheduler's flags only with --scheduler; parsing takes them anyway (a config file
    may name the scheduler)."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text("scheduler: slurm\nnnodes: 2\n")
    assert _submit(jobs_root, "--config", str(cfg), "--partition", "gpu", "--dry-run", "--json") == 0
    assert "#SBATCH --partition=gpu" in json.loads(capsys.readouterr().out)["files"]["job.sbatch"]
