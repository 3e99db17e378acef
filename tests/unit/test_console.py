"""A clean console: torch's known chatter is silenced by default, real warnings are not, and the debug
switch brings everything back. Each case runs in a fresh interpreter: filters are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainer.console import debug_requested

REPO_ROOT = Path(__file__).resolve().parents[2]
_SWITCHES = ("GPTLAUNCH_DEBUG", "TORCH_DISTRIBUTED_DEBUG", "TORCHINDUCTOR_")
# Emits each kind of message the way torch (or our code) does, then reports the Inductor switches.
_PROBE = """
import json, logging, sys, warnings
from trainer.console import quiet_torch_chatter

quiet_torch_chatter(compiling=True)
logging.basicConfig(stream=sys.stderr, format="%(message)s")
typed = "TypedStorage is deprecated. It will be removed in the future."
for module in ("torch._inductor.select_algorithm", "trainer.model"):  # warned from inside torch, and by us
    exec("import warnings; warnings.warn(typed, UserWarning)", {"__name__": module, "typed": typed})
warnings.warn("a real warning of ours", UserWarning)
logging.getLogger("torch._dynamo.variables.ctx_manager").warning(
    "Profiler record function %s will be ignored", "<class 'torch.autograd.profiler.record_function'>"
)
logging.getLogger("torch._dynamo.variables.ctx_manager").warning("a real dynamo warning")
import torch._inductor.config as c
print(json.dumps([c.autotune_num_choices_displayed, c.max_autotune_report_choices_stats]))
"""


def _probe(env: dict[str, str]) -> tuple[str, list[Any]]:
    # This environment, less any switch the test did not ask for.
    base = {k: v for k, v in os.environ.items() if not k.startswith(_SWITCHES)}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=REPO_ROOT,
        env=base | env,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stderr, json.loads(proc.stdout)


def test_known_chatter_is_silenced_and_real_warnings_are_not() -> None:
    stderr, inductor = _probe({})
    assert stderr.count("TypedStorage is deprecated") == 1  # ours still warns; torch's use does not
    assert "a real warning of ours" in stderr and "a real dynamo warning" in stderr
    assert "Profiler record function" not in stderr
    assert inductor == [0, False]  # no AUTOTUNE tables, no "Autotune Choices Stats"


@pytest.mark.parametrize(
    "env", [{"GPTLAUNCH_DEBUG": "1"}, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}], ids=["ours", "launcher-debug"]
)
def test_the_debug_switch_brings_everything_back(env: dict[str, str]) -> None:
    stderr, inductor = _probe(env)
    assert stderr.count("TypedStorage is deprecated") == 2 and "Profiler record function" in stderr
    assert inductor == [10, True]  # Inductor's defaults


def test_an_explicit_inductor_variable_wins() -> None:
    _, inductor = _probe({"TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED": "3"})
    assert inductor == [3, False]


def test_debug_is_requested_by_our_variable_or_distributed_detail() -> None:
    assert not debug_requested({})
    assert not debug_requested({"GPTLAUNCH_DEBUG": "0", "TORCH_DISTRIBUTED_DEBUG": "INFO"})
    assert debug_requested({"GPTLAUNCH_DEBUG": "true"})
    assert debug_requested({"TORCH_DISTRIBUTED_DEBUG": "detail"})
