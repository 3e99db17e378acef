"""The SLURM batch script's steps: the template's slots, the one shell variable the steps share (set
before any use, on both paths), and the standalone script's end step run by bash with a fake srun and
scontrol: the exit code, the requeue after a checkpoint on SIGUSR2, the message."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gptlaunch.contract import EXIT_CHECKPOINTED, write_stop_marker
from launcher.job import reports
from launcher.job.hang import EXIT_HANG, HangReport
from launcher.job.spec import JobSpec
from launcher.schedulers.slurm.end import REQUEUE, ending
from launcher.schedulers.slurm.scheduler import SCRIPT, SUBMITIT_SCRIPT, SlurmFacts, SlurmScheduler
from launcher.schedulers.slurm.script import fill

_ASSIGNED = re.compile(r"(?:^|[\s;(&|{])(?:export )?([A-Za-z_]\w*)=", re.M)
_USED = re.compile(r"\$\{?([A-Za-z_]\w*)")


def _spec(tmp_path: Path, **scheduler: object) -> JobSpec:
    return JobSpec.model_validate(
        {
            "nnodes": 2,
            "python": sys.executable,
            "scheduler": {"kind": "slurm", "max_requeues": 2, **scheduler},
            "trainer_args": ["--run-dir", str(tmp_path / "run")],
        }
    )


def _files(spec: JobSpec, tmp_path: Path) -> dict[str, str]:
    facts = SlurmFacts(workdir=str(tmp_path), gpus_per_node=0)
    return SlurmScheduler().render(spec, facts, "j", tmp_path / "job").files


def _unassigned(script: str) -> list[str]:
    """The lowercase shell variables ``script`` reads before it assigns them (comments and single-quoted
    text are not expanded; uppercase names are the environment's: SLURM's and the exported ones)."""
    code = "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in script.splitlines())
    lines = re.sub(r"'[^']*'", "''", code).splitlines()
    missing = []
    for k, line in enumerate(lines):
        assigned = set(_ASSIGNED.findall("\n".join(lines[: k + 1])))
        missing += [name for name in _USED.findall(line) if name.islower() and name not in assigned]
    return missing


def test_every_shell_variable_is_set_before_it_is_read_on_both_paths(tmp_path: Path) -> None:
    spec = _spec(tmp_path, health_check=True).model_copy(update={"retries": 2})
    files = _files(spec, tmp_path)
    for name in (SCRIPT, SUBMITIT_SCRIPT):
        assert "$run_started" in files[name], name  # the variable the check is about is there to see
        assert _unassigned(files[name]) == [], name
    assert _unassigned('echo "$later"\nlater=1') == ["later"]  # the check sees a read before the set


def test_the_template_refuses_a_slot_left_empty_or_a_value_for_none() -> None:
    assert fill("a @x@ b", {"x": "1"}) == "a 1 b"
    assert fill("@x@", {"x": "@y@"}) == "@y@"  # a value is not scanned again
    with pytest.raises(ValueError, match="differ"):
        fill("@x@ @y@", {"x": "1"})
    with pytest.raises(ValueError, match="differ"):
        fill("@x@", {"x": "1", "z": "2"})


def _end(tmp_path: Path, code: int, restarts: int = 0) -> tuple[int, str]:
    return ending(
        exit_code=code,
        run_dir=tmp_path,
        job_dir=tmp_path / "job",
        since=0.0,
        restarts=restarts,
        max_requeues=2,
    )


def test_the_end_step_requeues_only_after_a_checkpoint_on_the_warning_signal(tmp_path: Path) -> None:
    assert _end(tmp_path, 1) == (1, f"a node failed (srun exit 1); see {tmp_path / 'job'}/node-*.log")
    assert _end(tmp_path, EXIT_HANG)[0] == EXIT_HANG  # a node's own exit code, with no report: passed on
    # A peer that srun stopped with SIGTERM as it exited made srun's code 15: the hang report decides.
    reports.append(
        tmp_path / "job", reports.Hang(node=1, hang=HangReport(silent_s=11, budget_s=10, step=3, ranks=[]))
    )
    code, said = _end(tmp_path, 15)
    assert code == EXIT_HANG and "hung" in said and str(tmp_path / "job" / "hang") in said
    write_stop_marker(tmp_path, 7, tmp_path / "ckpt-7.pt", "SIGUSR2")
    assert _end(tmp_path, 1) == (REQUEUE, "checkpoint saved; requeueing (restart 1 of at most 2)")
    assert _end(tmp_path, 1, restarts=2)[0] == EXIT_CHECKPOINTED  # no requeue left
    write_stop_marker(tmp_path, 7, tmp_path / "ckpt-7.pt", "SIGTERM")
    assert _end(tmp_path, 1) == (
        EXIT_CHECKPOINTED,
        "stopped after the checkpoint of step 7; submit again to resume",
    )


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


# The parity step's srun writes this machine's real probe as both nodes' report; the training step's
# writes a stop marker when asked to (STOP=SIGUSR2) and exits with SRUN_EXIT; scontrol records its
# arguments.
_SRUN = """import os, subprocess, sys
from pathlib import Path
from gptlaunch.contract import write_stop_marker
if "launcher.preflight.probe" in sys.argv:
    output = next(a for a in sys.argv if a.startswith("--output=")).split("=", 1)[1]
    probe = [sys.executable, "-m", "launcher.preflight.probe", "--json"]
    report = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    for node in (0, 1):
        open(output.replace("%n", str(node)), "w").write(report)
elif "--kill-on-bad-exit=1" in sys.argv:
    if os.environ.get("STOP"):
        write_stop_marker(Path(os.environ["RUN_DIR"]), 3, Path("ckpt-3.pt"), os.environ["STOP"])
    sys.exit(int(os.environ["SRUN_EXIT"]))
"""
_SCONTROL = """import os, sys
if sys.argv[1] == "requeue":
    open(os.environ["SCONTROL_LOG"], "a").write(" ".join(sys.argv[1:]) + "\\n")
else:
    print("n1")
"""


@pytest.mark.parametrize(
    ("srun_exit", "stop", "exit_code", "requeued", "said"),
    [
        (0, "", 0, False, ""),
        (1, "", 1, False, "batch: a node failed (srun exit 1)"),
        (1, "SIGUSR2", 0, True, "batch: checkpoint saved; requeueing (restart 1 of at most 2)"),
        (1, "SIGTERM", EXIT_CHECKPOINTED, False, "batch: stopped after the checkpoint of step 3"),
    ],
)
def test_the_standalone_script_ends_with_the_steps_decision(
    tmp_path: Path, srun_exit: int, stop: str, exit_code: int, requeued: bool, said: str
) -> None:
    spec = _spec(tmp_path)
    (tmp_path / "run").mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "srun", _SRUN)
    _fake(bin_dir, "scontrol", _SCONTROL)
    script = tmp_path / SCRIPT
    script.write_text(_files(spec, tmp_path)[SCRIPT])
    log = tmp_path / "scontrol.log"
    env = os.environ | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1",
        "SRUN_EXIT": str(srun_exit), "STOP": stop, "RUN_DIR": str(tmp_path / "run"), "SCONTROL_LOG": str(log),
    }  # fmt: skip
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == exit_code, proc.stdout + proc.stderr
    assert (log.read_text() if log.exists() else "") == ("requeue 42\n" if requeued else "")
    assert said in proc.stdout, proc.stdout
