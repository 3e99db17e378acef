"""The trainer's structure: no import cycle (lazy imports count), who may import what, module sizes.

Imports are read from the source (every ``import`` statement, at any depth: inside functions and
``if TYPE_CHECKING`` blocks too), as import-linter's graph does, so a cycle kept alive by a lazy import
is still one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import trainer.data
import trainer.precheck

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50
# What trainer.data may import from the trainer (its __init__ docstring says so).
DATA_MAY_IMPORT = ("trainer.data", "trainer.errors", "gptlaunch.contract")


def _module_name(path: Path) -> str:
    parts = path.relative_to(TRAINER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(TRAINER.rglob("*.py"))}


def _imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, at any depth; ``from pkg import mod`` names ``pkg.mod``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: use absolute imports"
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield sub if sub in MODULES else node.module


def _graph() -> dict[str, set[str]]:
    return {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_lazy_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_trainer() -> None:
    assert _cycle(_graph()) is None


def test_the_trainer_never_imports_the_launcher() -> None:
    for name, path in MODULES.items():
        bad = [m for m in _imports(path) if m == "launcher" or m.startswith("launcher.")]
        assert not bad, f"{name} imports {bad}"


def test_the_data_package_imports_only_what_its_docstring_allows() -> None:
    for name, path in MODULES.items():
        if name == "trainer.data" or name.startswith("trainer.data."):
            ours = [m for m in _imports(path) if m.startswith("trainer")]
            bad = [m for m in ours if not any(m == ok or m.startswith(ok + ".") for ok in DATA_MAY_IMPORT)]
            assert not bad, f"{name} imports {bad}"
    assert "may import only" in (trainer.data.__doc__ or "")


def test_the_launcher_finds_what_it_needs_in_precheck() -> None:
    needs = ("check_train_args", "InvalidTrainerArgs", "parse_train_args", "expand_text_files", "DataError")
    for needed in needs:
        assert needed in trainer.precheck.__all__ and hasattr(trainer.precheck, needed)


def test_no_module_is_too_long() -> None:
    for name, path in MODULES.items():
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines"


def test_no_function_is_too_long() -> None:
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                assert lines <= MAX_FUNCTION_LINES, f"{name}.{node.name} has {lines} lines"
