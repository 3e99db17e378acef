"""The docs' reference pages are generated from the parsers and the models (``tools/reference.py``):
a committed page that differs from what they make now fails, with the command that mends it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gptlaunch import contract
from launcher.cli.fields import describe_fields
from launcher.cli.main import _parser
from launcher.job.record import JobState
from tools.reference import PAGES, cli_page, config_page, exit_codes_page

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_committed_reference_page_is_what_the_parsers_and_models_make(name: str) -> None:
    committed = (REFERENCE / name).read_text()
    assert committed == PAGES[name](), f"docs/reference/{name} is stale: run `make reference`, then commit"


def test_every_flag_of_submit_is_in_the_cli_reference() -> None:
    submit = next(a for a in _parser(None)._actions if a.dest == "command").choices["submit"]  # type: ignore[attr-defined]
    flags = {s for a in submit._actions for s in a.option_strings if s.startswith("--")}
    page = cli_page()
    hidden = {s for a in submit._actions if a.help == "==SUPPRESS==" for s in a.option_strings}
    assert flags - hidden and all(flag in page for flag in flags - hidden), sorted(
        f for f in flags - hidden if f not in page
    )


def test_every_config_field_is_in_the_config_reference_with_its_flag() -> None:
    page = config_page()
    for name, flag, _ in describe_fields(shown=None):
        # a field several schedulers share (scheduler.gpus) has a row in each scheduler's table
        rows = [line for line in page.splitlines() if line.startswith(f"| `{name}` |")]
        assert rows, name
        assert not flag or any(f"`{flag}`" in row for row in rows), (name, flag, rows)


def test_every_exit_code_and_state_is_in_one_table() -> None:
    page = exit_codes_page()
    codes = {v for k, v in vars(contract).items() if k.startswith("EXIT_")}
    assert codes <= {int(c) for c in re.findall(r"^\| (\d+) \|", page, re.M)}
    assert all(f"| `{s.value}` |" in page for s in JobState)
