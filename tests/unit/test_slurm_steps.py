"""The SLURM batch script's steps: the template's slots, and no shell variable read before it is set,
on both paths."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from launcher.job.spec import JobSpec
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
        assert "$SLURM_JOB_NODELIST" in files[name], name  # a variable for the check to see
        # the job record's quoted heredoc is not expanded (its "[rank${rank}]" is torchelastic's)
        assert _unassigned(re.sub(r"<<'RECORD'.*?\nRECORD\n", "\n", files[name], flags=re.S)) == [], name
    assert _unassigned('echo "$later"\nlater=1') == ["later"]  # the check sees a read before the set


def test_the_template_refuses_a_slot_left_empty_or_a_value_for_none() -> None:
    assert fill("a @x@ b", {"x": "1"}) == "a 1 b"
    assert fill("@x@", {"x": "@y@"}) == "@y@"  # a value is not scanned again
    with pytest.raises(ValueError, match="differ"):
        fill("@x@ @y@", {"x": "1"})
    with pytest.raises(ValueError, match="differ"):
        fill("@x@", {"x": "1", "z": "2"})
