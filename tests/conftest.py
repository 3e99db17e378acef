"""Shared fixtures: real text from ../shared/data, skipped with a reason when absent (a failure under
CI=true, whose .ci/run has ../shared beside the clone)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import NoReturn

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2"

# tests/gpu needs a CUDA GPU, which CI never has: collected only when asked for (make gpu-test).
collect_ignore = [] if os.environ.get("GPTLAUNCH_GPU_TESTS") == "1" else ["gpu"]

# A shell without job control starts `make test &` with SIGINT ignored, and every launcher the tests
# start would inherit that and shrug off the Ctrl-C the stop tests send: restore what a terminal gives.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def wikitext_valid() -> Path:
    """Path of WikiText-2's validation split (real text, ~1.1 MB) from ../shared."""
    path = SHARED_DATA / "valid.txt"
    if not path.is_file():
        missing_component(f"real text not found at {path}: put the shared/ folder beside the repository")
    return path


def missing_component(problem: str) -> NoReturn:
    """A real component a test needs (SLURM, sshd, Docker, the shared text) is missing: fail under
    CI=true, else skip."""
    if os.environ.get("CI") == "true":
        pytest.fail(problem)
    pytest.skip(problem)
