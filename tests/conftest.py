"""Shared fixtures: real text from ../shared/data, skipped with a reason when absent."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data" / "wikitext-2"


@pytest.fixture(scope="session")
def wikitext_valid() -> Path:
    """Path of WikiText-2's validation split (real text, ~1.1 MB) from ../shared."""
    path = SHARED_DATA / "valid.txt"
    if not path.is_file():
        pytest.skip(f"real text not found at {path}: put the shared/ folder beside the repository")
    return path
