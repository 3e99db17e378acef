"""Tests of the CUDA paths, for a machine with a GPU (``make gpu-test``; ``../shared/GPU.md``). CI has
no GPU: ``tests/conftest.py`` leaves this folder out unless ``GPTLAUNCH_GPU_TESTS=1``, and here a
missing GPU is a failure, never a skip."""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import no_leftover_processes, prepared_data  # noqa: F401 (fixtures)


@pytest.fixture(autouse=True)
def cuda_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.fail("no CUDA GPU: tests/gpu runs on a machine with one (make gpu-test)")
