"""The launcher's up-front check of trainer arguments: user errors named, bugs not hidden, no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer import precheck
from trainer.precheck import InvalidTrainerArgs, check_train_args

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_checking_arguments_imports_no_torch_numpy_or_tokenizers() -> None:
    code = (
        "import sys, trainer.precheck as p; p.check_train_args(['--max-steps', '3'], world_size=2); "
        "print([m for m in ('torch', 'numpy', 'tokenizers', 'datasets') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_good_arguments_pass(wikitext_valid: Path) -> None:
    check_train_args(["--text-files", str(wikitext_valid), "--max-steps", "3"], world_size=2)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--max-steps", "-5"], "--max-steps"),
        (["--global-batch-tokens", "1000"], "--global-batch-tokens 1000"),  # does not split over 2 ranks
        (["--vocab-size", "70000", "--token-dtype", "uint16"], "--token-dtype uint32"),
    ],
)
@pytest.mark.parametrize("files_here", [True, False])
def test_user_errors_name_the_flag_wherever_the_files_are(
    argv: list[str], named: str, files_here: bool
) -> None:
    with pytest.raises(InvalidTrainerArgs) as excinfo:
        check_train_args(argv, world_size=2, files_here=files_here)
    assert named in str(excinfo.value)


def test_local_files_are_checked_only_where_they_are(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    cases = [
        (["--text-files", str(tmp_path / "missing.txt")], "not found"),
        (["--text-files", str(tmp_path / "*.md")], "matched no files"),
        (["--text-files", str(empty)], "empty"),
        (["--resume", str(tmp_path / "ckpt-00000009.pt")], "--resume"),
    ]
    for argv, expected in cases:
        with pytest.raises(InvalidTrainerArgs, match=r"fix:|use auto") as excinfo:
            check_train_args(argv, world_size=1)
        assert expected in str(excinfo.value)
        # A SLURM or SSH job: these paths are the cluster's, not this machine's.
        check_train_args(argv, world_size=1, files_here=False)


def test_argparse_exits_propagate_unchanged(capsys) -> None:
    with pytest.raises(SystemExit) as excinfo:
        check_train_args(["--no-such-flag"], world_size=1)
    assert excinfo.value.code == 2 and "--no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit) as excinfo:
        check_train_args(["--help"], world_size=1)
    assert excinfo.value.code == 0


def test_a_bug_is_not_reported_as_invalid_input(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object, **_kwargs: object) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(precheck, "check_source", broken)
    with pytest.raises(KeyError, match="a bug"):
        check_train_args([], world_size=1)
