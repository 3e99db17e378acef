"""SLURM rendering: the golden sbatch script, quoting that survives bash, the options' validation."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gptlaunch.contract import EXIT_USAGE, FIRST_HOST_ENV
from launcher.cli.main import main
from launcher.job.placeholders import substitute
from launcher.job.plan import Plan
from launcher.job.record import JobState
from launcher.job.spec import JobSpec
from launcher.schedulers.slurm.options import PORT_BASE, PORT_SPAN, SlurmOptions, slurm_minutes, time_note
from launcher.schedulers.slurm.scheduler import (
    SCRIPT,
    SUBMITIT_SCRIPT,
    SlurmFacts,
    SlurmScheduler,
    gpus_asked,
)
from launcher.schedulers.slurm.state import job_state

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
FACTS = {"workdir": "/work/job", "gpus_per_node": 0}
HOSTILE = ["a'; touch {m}", "$(touch {m})", "`touch {m}`", "two  spaces", 'a"=0"', "semi;colon", "*"]


def _spec(**fields: object) -> JobSpec:
    base: dict[str, object] = {
        "name": "gold",
        "nnodes": 2,
        "nproc_per_node": 1,
        "python": "python3",
        "scheduler": {"kind": "slurm", "partition": "debug", "time": "1:30:00", "account": "ml"},
        "trainer_args": ["--max-steps", "30", "--text-files", "/data/a b.txt"],
    }
    return JobSpec.model_validate(base | fields)


def _render(spec: JobSpec, job_dir: str = "/jobs/gold-job", **facts: object) -> Plan:
    return SlurmScheduler().render(spec, SlurmFacts(**FACTS | facts), "gold-job", Path(job_dir))


def _check_golden(text: str, name: str) -> None:
    golden = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"rendering changed: UPDATE_GOLDEN=1 pytest {__file__} to accept"


def test_sbatch_script_matches_golden_file() -> None:
    _check_golden(_render(_spec(), gpus_per_node=1).to_text(), "slurm_2x1.sbatch")


def test_sbatch_script_with_the_health_gate_matches_golden_file() -> None:
    scheduler = {"kind": "slurm", "partition": "debug", "health_check": True, "min_busbw": 2.5}
    _check_golden(_render(_spec(scheduler=scheduler), gpus_per_node=1).to_text(), "slurm_preflight.sbatch")


def test_sbatch_script_with_shell_hostile_values_matches_golden_file() -> None:
    values = [h.format(m="/tmp/pwned") for h in HOSTILE]
    spec = _spec(network={"env": {"HOSTILE": values[1]}}, trainer_args=["--run-dir", values[0], *values[1:]])
    plan = _render(spec, job_dir="/jobs/a 'b' $(c)")
    _check_golden(plan.to_text(), "slurm_hostile.sbatch")
    # submitit's, as its submit writes it: the job folder quoted in its #SBATCH paths and its command
    _check_golden(plan.files[SUBMITIT_SCRIPT], "slurm_submitit_hostile.sbatch")


# The parity step's srun writes the real probe report as both nodes' output; the training srun records
# its arguments, the environment value HOSTILE and its working directory.
_RECORDING_SRUN = """import json, os, subprocess, sys
args = sys.argv[1:]
if "launcher.preflight.probe" in args:
    output = next(a for a in args if a.startswith("--output=")).split("=", 1)[1]
    probe = [sys.executable, "-m", "launcher.preflight.probe", "--json"]
    report = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    for node in (0, 1):
        open(output.replace("%n", str(node)), "w").write(report)
else:
    json.dump([args, os.environ["HOSTILE"], os.getcwd()], open({record!r}, "w"))
"""


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_the_script_hands_hostile_values_to_srun_verbatim(tmp_path: Path) -> None:
    """Run the rendered script with bash, a recording `srun` in place of SLURM's (the parity step's
    srun runs the real probe for both nodes): every hostile value arrives as one argument or environment
    value, unchanged, and nothing in it is executed."""
    marker = tmp_path / "pwned"
    values = [h.format(m=marker) for h in HOSTILE]
    job_dir = tmp_path / "job 'dir' $(touch x)"
    spec = _spec(
        python=sys.executable,
        network={"env": {"HOSTILE": values[1]}},
        trainer_args=["--run-dir", str(tmp_path), *values],
    )
    plan = _render(spec, job_dir=str(job_dir), workdir=str(tmp_path))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.json"
    _fake(bin_dir, "srun", _RECORDING_SRUN.format(record=str(record)))
    _fake(bin_dir, "scontrol", 'print("n1\\nn2")  # show hostnames')
    script = tmp_path / SCRIPT
    script.write_text(plan.to_text())
    slurm = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    env = os.environ | slurm | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the controller ran both nodes' steps
    argv, hostile_env, cwd = json.loads(record.read_text())  # a node agent's step, as srun got it
    assert argv[-len(values) :] == values and {"--nodes=1", "--ntasks=1"} <= set(argv)
    assert hostile_env == values[1] and cwd == str(tmp_path)
    assert json.loads((job_dir / "status.json").read_text())["state"] == "succeeded"  # its record
    assert job_dir.is_dir() and not marker.exists() and not (tmp_path / "x").exists()
    assert "version parity: the 2 nodes match" in proc.stdout  # the step before training ran, and passed


def test_a_missing_workdir_stops_the_batch_script_naming_it_before_any_step(tmp_path: Path) -> None:
    workdir = tmp_path / "no such $(touch x)"
    plan = _render(_spec(python=sys.executable), job_dir=str(tmp_path / "job"), workdir=str(workdir))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "srun", f"open({str(tmp_path / 'srun-ran')!r}, 'w')")
    script = tmp_path / SCRIPT
    script.write_text(plan.to_text())
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert f"workdir {workdir} is not a directory on {socket.gethostname()}" in proc.stdout
    assert not (tmp_path / "srun-ran").exists() and not (tmp_path / "x").exists()


def test_the_node_command_refuses_a_missing_workdir_naming_the_host(tmp_path: Path) -> None:
    """What srun's tasks (and submitit's) run: without the check srun would start them in /tmp."""
    node = [sys.executable, "-m", "launcher.job.node", "--workdir"]
    missing = subprocess.run([*node, str(tmp_path / "gone"), "--", "pwd"], capture_output=True, text=True)
    assert missing.returncode == EXIT_USAGE and not missing.stdout
    assert f"{tmp_path / 'gone'} on host {socket.gethostname()}" in missing.stderr, missing.stderr
    there = subprocess.run([*node, str(tmp_path), "--", "pwd"], capture_output=True, text=True, check=True)
    assert there.stdout.strip() == str(tmp_path)


def test_every_node_meets_node_0s_host_at_a_port_from_the_job_id() -> None:
    """Each node's agent runs its torchrun with its own rank (a static rendezvous), behind the node
    entry that fills in node 0's host (set by the controller) and the port from SLURM's job id."""
    plan = _render(_spec())
    assert len(plan.nodes) == 2 and len({n.log for n in plan.nodes}) == 2
    for k, node in enumerate(plan.nodes):
        argv = node.argv
        assert argv[1:4] == ["-m", "launcher.agent", "run"] and argv[argv.index("--node") + 1] == str(k)
        entry = argv.index("launcher.job.node")
        assert argv[entry + 1 : entry + 4] == ["--workdir", node.cwd, "--"]
        assert "--rdzv-backend=static" in argv and f"--node-rank={k}" in argv
        assert "--rdzv-endpoint={{first_host}}:{{rdzv_port}}" in argv
        assert next(a for a in argv if a.startswith("--log-dir")).endswith(f"/node-{k}")
    env = {"SLURM_JOB_ID": "123456", FIRST_HOST_ENV: "n3"}
    assert substitute("{{first_host}}:{{rdzv_port}}", env) == f"n3:{PORT_BASE + 123456 % PORT_SPAN}"


def test_gpus_are_requested_only_when_wanted() -> None:
    assert "--gpus-per-node=1" not in _render(_spec()).to_text()
    assert "#SBATCH --gpus-per-node=1" in _render(_spec(), gpus_per_node=1).to_text()
    spec = _spec(scheduler={"kind": "slurm", "gpus": False})
    assert SlurmScheduler().resolve(spec).gpus_per_node == 0


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("90", 90), ("1:30:00", 90), ("0:30", 1), ("2-0", 2880), ("1-1:01:01", 1502), ("5:00", 5)],
)
def test_slurm_time_forms(text: str, minutes: int) -> None:
    assert slurm_minutes(text) == minutes


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--time", "1h"], "'1h' is not a SLURM time"),
        (["--time", "0"], "no time at all"),
        (["--mem", "lots"], "not a SLURM memory size"),
        (["--partition", "a b"], "without spaces"),
        (["--slurm-opt", "nodes=3"], "set by the launcher: use --nodes"),
        (["--slurm-opt", "Bad_Key=1"], "not an sbatch option name"),
        (["--env", "HF_TOKEN=x"], "HF_TOKEN is secret"),
        (["--secret-env", "MY_KEY", "--env", "MY_KEY=x"], "MY_KEY is secret"),
        (["--time", "2"], "leaves under a minute"),
        (["--signal-delay-s", "40"], "must exceed grace_period_s"),
    ],
)
def test_bad_slurm_options_are_clear_errors(args: list[str], needle: str, tmp_path: Path, capsys) -> None:
    code = main(["--jobs-root", str(tmp_path), "render", "--scheduler", "slurm", *args])
    assert code == 2 and needle in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_default_secrets_stay_secret_when_a_config_lists_others() -> None:
    with pytest.raises(ValueError, match="HF_TOKEN is secret"):
        JobSpec.model_validate({"secret_env": ["MY_KEY"], "network": {"env": {"HF_TOKEN": "x"}}})


def test_render_prints_the_submission_file_submitit_hands_to_sbatch(tmp_path: Path, capsys) -> None:
    """``--file submitit.sbatch``: submitit's own rendering of the job (what ``submit`` hands to sbatch
    on that path), with the steps before training and the node tasks; the default stays the standalone
    script (the other path: ``sbatch`` it yourself)."""
    args = ["--jobs-root", str(tmp_path), "render", "--scheduler", "slurm", "--nodes", "2"]
    path = os.environ["PATH"]
    assert main([*args, "--file", "submitit.sbatch"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --nodes=2\n" in text
    assert "-m submitit.core._submit " in text and "launcher.preflight.parity_step" in text
    assert "launcher-render-" not in text and os.environ["PATH"] == path  # the stand-in sbatch is gone
    assert main(args) == 0 and "# Version parity" in capsys.readouterr().out
    assert main([*args, "--file", "nosuch"]) == 2
    assert "--file nosuch: the Plan has job.sbatch, submitit.json, submitit.sbatch" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_an_option_of_another_scheduler_names_it(tmp_path: Path, capsys) -> None:
    assert main(["--jobs-root", str(tmp_path), "render", "--partition", "debug"]) == 2
    assert "it is an option of --scheduler slurm" in capsys.readouterr().err


def test_pass_through_options_reach_the_script() -> None:
    opts = {"kind": "slurm", "sbatch": {"exclusive": True, "mail-type": "END"}}
    text = _render(_spec(scheduler=opts)).to_text()
    assert "#SBATCH --exclusive\n" in text and "#SBATCH --mail-type=END\n" in text
    assert SlurmOptions.model_validate(opts).sbatch == {"exclusive": "", "mail-type": "END"}


@pytest.mark.parametrize(
    ("word", "state"),
    [
        ("PENDING", JobState.PENDING),
        ("REQUEUED", JobState.PENDING),
        ("RUNNING", JobState.RUNNING),
        ("COMPLETING", JobState.RUNNING),
        ("COMPLETED", JobState.SUCCEEDED),
        ("CANCELLED", JobState.CANCELLED),
        ("TIMEOUT", JobState.FAILED),
        ("NODE_FAIL", JobState.FAILED),
        ("SOMETHING_NEW", None),
    ],
)
def test_slurm_states_map_to_the_common_states(word: str, state: JobState | None) -> None:
    assert job_state(word) == state


def test_a_time_limit_in_slurms_mm_ss_form_is_said_in_words(tmp_path: Path, capsys) -> None:
    """``4:00`` reads as four hours and is four minutes in sbatch: the render says so, and the fix."""
    assert (
        time_note("4:00") == "--time 4:00 is 4 minute(s) 0 second(s) (SLURM's MM:SS); for 4 hours say 4:00:00"
    )
    assert [time_note(t) for t in ("90", "4:00:00", "1-12", "1-12:00")] == [None] * 4
    args = ["--jobs-root", str(tmp_path), "render", "--scheduler", "slurm", "--nodes", "2", "--time", "4:00"]
    assert main([*args, "--", "--max-steps", "3"]) == 0
    assert "launcher: note: --time 4:00 is 4 minute(s)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("sinfo", "asked", "said"),
    [
        ("(null)\n(null)\n", False, "the nodes of partition debug have no GPU in their GRES (sinfo: (null))"),
        ("gpu:8\n(null)\n", True, ""),
        (None, True, ""),  # no sinfo here: the GPU clusters this is for
    ],
)
def test_no_gpus_are_requested_silently(sinfo, asked, said, monkeypatch, capsys) -> None:
    """A partition whose GRES has no GPU gets none requested, and the job says so, with the flag."""

    def fake_sinfo(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        assert argv[:3] == ["sinfo", "--noheader", "--format=%G"] and "--partition=debug" in argv
        if sinfo is None:
            raise FileNotFoundError("sinfo")
        return subprocess.CompletedProcess(argv, 0, stdout=sinfo)

    monkeypatch.setattr(subprocess, "run", fake_sinfo)
    spec = _spec(scheduler={"kind": "slurm", "partition": "debug"}, nproc_per_node=4)
    assert gpus_asked(spec, spec.options(SlurmOptions)) is asked
    err = capsys.readouterr().err
    assert said in err and (("--slurm-gpus requests them" in err) == (not asked))
    assert ("4 CPU process(es)" in err) == (not asked)
