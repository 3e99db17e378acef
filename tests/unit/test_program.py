"""The user's own program: torchrun's three forms after ``--``, how it is rendered on every node, the
shim that runs it watched (real interpreters), and the runtime API, inert under bare torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gptlaunch.contract import (
    ATTEMPT_ENV,
    HEARTBEAT_DIR_ENV,
    JOB_ID_ENV,
    RESUME_ARGS_ENV,
    RUN_DIR_ENV,
    read_beats,
    read_stop_marker,
)
from launcher.job.spec import Program, SpecError, split_program

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("tail", "program", "trainer_args"),
    [
        (["train.py", "--lr", "3"], Program(kind="script", target="train.py", args=["--lr", "3"]), []),
        (["-m", "pkg.train", "-x"], Program(kind="module", target="pkg.train", args=["-x"]), []),
        (["--no-python", "./run.sh", "a"], Program(kind="no_python", target="./run.sh", args=["a"]), []),
        (["--max-steps", "5"], None, ["--max-steps", "5"]),  # the built-in trainer's flags
        ([], None, []),
    ],
)
def test_the_three_forms_of_torchrun_and_the_trainers_flags(
    tail: list[str], program: Program | None, trainer_args: list[str]
) -> None:
    assert split_program(tail) == (program, trainer_args)


def test_a_form_without_its_name_is_refused() -> None:
    with pytest.raises(SpecError, match="needs a name after it"):
        split_program(["-m"])


@pytest.mark.parametrize("tail", [["-m", ""], ["a\x01.py"]])
def test_a_bad_program_name_is_a_usage_error_naming_the_field(tail: list[str], tmp_path: Path) -> None:
    proc = _launcher("render", "--", *tail, cwd=tmp_path)
    assert proc.returncode == 2 and "program.target: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_programs_run_through_the_shim_but_a_no_python_one() -> None:
    assert Program(kind="script", target="t.py", args=["-a"]).argv() == ["-m", "gptlaunch.shim", "t.py", "-a"]
    assert Program(kind="module", target="p.m").argv() == ["-m", "gptlaunch.shim", "-m", "p.m"]
    assert Program(kind="no_python", target="./b").argv() == ["--no-python", "./b"]


def _launcher(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(cwd / "jobs"), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_render_shows_the_program_on_every_node_with_its_run_dir_and_resume_args() -> None:
    out = _launcher(
        "render", "--json", "--nodes", "2", "--resume-args", "--init-from resume",
        "--", "examples/ddp_plain.py", "--steps", "3", "--out={{run_dir}}",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    for node in plan["nodes"]:
        command = node["argv"][node["argv"].index("--") + 1 :]
        shim = ["-m", "gptlaunch.shim", "examples/ddp_plain.py", "--steps", "3", f"--out={plan['run_dir']}"]
        assert command[-6:] == shim
        assert "trainer.cli" not in command
        assert node["env"][RUN_DIR_ENV] == plan["run_dir"]
        assert json.loads(node["env"][RESUME_ARGS_ENV]) == ["--init-from", "resume"]


def test_the_sbatch_script_runs_the_program_through_the_shim() -> None:
    out = _launcher(
        "render", "--scheduler", "slurm", "--nodes", "2", "--", "examples/ddp_plain.py", "--steps", "3"
    )
    assert out.returncode == 0, out.stderr
    script = out.stdout  # each node's command, in the job record the script carries
    assert '"-m", "gptlaunch.shim", "examples/ddp_plain.py", "--steps", "3"' in script
    assert "trainer.cli" not in script


def test_a_missing_script_and_resume_args_without_a_program_are_named(tmp_path: Path) -> None:
    missing = _launcher("render", "--", "nope.py", cwd=tmp_path)
    assert missing.returncode == 2 and "nope.py is not a file in the working directory" in missing.stderr
    resume = _launcher("render", "--resume-args=--x", "--", "--max-steps", "3", cwd=tmp_path)
    assert resume.returncode == 2 and "--resume-args is for your own program" in resume.stderr
    assert "Traceback" not in missing.stderr + resume.stderr


SCRIPT = """
import sys
print("argv", sys.argv[1:], __name__, flush=True)
if "--fail" in sys.argv:
    raise ValueError("the script's own error")
sys.exit(int(sys.argv[1]))
"""


def _shim(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "gptlaunch.shim", str(script), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=os.environ | (env or {}))


def test_the_shim_runs_the_script_as_python_would_with_its_exit_code(tmp_path: Path) -> None:
    ran = _shim(tmp_path, "3", "--a")
    assert ran.returncode == 3 and "argv ['3', '--a'] __main__" in ran.stdout
    failed = _shim(tmp_path, "0", "--fail")
    assert failed.returncode == 1 and "ValueError: the script's own error" in failed.stderr


def test_the_shim_writes_each_line_whole_even_unbuffered(tmp_path: Path) -> None:
    # print's text and newline in one write: torchrun's rank prefix cannot land between them.
    script = tmp_path / "streams.py"
    script.write_text(
        "import sys\nfor s in (sys.stdout, sys.stderr): print(s.line_buffering, s.write_through)\n"
    )
    argv = [sys.executable, "-m", "gptlaunch.shim", str(script)]
    ran = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONUNBUFFERED": "1"}
    )
    assert ran.stdout.splitlines() == ["True False", "True False"], ran.stdout + ran.stderr


def test_the_shim_adds_the_resume_args_from_the_second_attempt_on(tmp_path: Path) -> None:
    env = {JOB_ID_ENV: "j", RESUME_ARGS_ENV: json.dumps(["--init_from=resume"])}
    first = _shim(tmp_path, "0", env=env | {ATTEMPT_ENV: "1"})
    second = _shim(tmp_path, "0", env=env | {ATTEMPT_ENV: "2"})
    assert "argv ['0'] __main__" in first.stdout
    assert "argv ['0', '--init_from=resume'] __main__" in second.stdout


TRAINS = """
import torch
model = torch.nn.Linear(2, 1)
first, second = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(7):
    model(torch.ones(1, 2)).sum().backward()
    first.step()
    second.step()  # a second optimizer: its steps are not counted again
"""


def test_every_optimizer_step_beats_with_no_change_to_the_script(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(TRAINS)
    beats = tmp_path / "beats"
    env = os.environ | {JOB_ID_ENV: "j", HEARTBEAT_DIR_ENV: str(beats), "RANK": "0"}
    argv = [sys.executable, "-m", "gptlaunch.shim", str(script)]
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0, ran.stderr
    [beat] = read_beats(beats)
    assert (beat.rank, beat.step, beat.phase) == (0, 7, "step")
    assert beat.debug_socket is not None  # the flight recorder's server


API = """
import os, signal, sys
from gptlaunch import runtime
print(runtime.launched(), runtime.attempt(), runtime.checkpoint_dir(), runtime.stop_requested(), flush=True)
print("handler", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
if runtime.launched():
    os.kill(os.getpid(), signal.SIGTERM)  # handled: no longer the default (death)
    print("stop", runtime.stop_requested(), flush=True)
runtime.exit_checkpointed(12, "ckpt-12.pt")
"""


def test_the_api_is_inert_under_bare_torchrun(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPTLAUNCH_")}
    ran = subprocess.run([sys.executable, "-c", API], capture_output=True, text=True, timeout=60, env=env)
    assert ran.returncode == 75, ran.stderr
    assert ran.stdout.splitlines() == ["False 1 None False", "handler True"]


def test_a_stop_is_answered_with_the_stop_marker_and_exit_75(tmp_path: Path) -> None:
    env = os.environ | {JOB_ID_ENV: "j", RUN_DIR_ENV: str(tmp_path), ATTEMPT_ENV: "2", "RANK": "0"}
    ran = subprocess.run([sys.executable, "-c", API], capture_output=True, text=True, timeout=60, env=env)
    assert ran.returncode == 75, ran.stderr
    assert ran.stdout.splitlines() == [f"True 2 {tmp_path} False", "handler False", "stop True"]
    marker = read_stop_marker(tmp_path, since=0)
    assert marker is not None
    assert (marker.step, marker.checkpoint, marker.signal) == (12, "ckpt-12.pt", "SIGTERM")
