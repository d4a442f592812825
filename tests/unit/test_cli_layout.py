"""The CLI stays in small pieces (issue 47): each subcommand's parser is built by its own module, shared flag groups
by small functions, and main.py only assembles the parser and dispatches. Read with `ast`: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CLI = Path(__file__).resolve().parents[2] / "src" / "mixtrain" / "cli"
MAX_FUNCTION_LINES = 60
MAX_MAIN_LINES = 400


def _functions(path: Path) -> list[tuple[str, int]]:
    """(name:line, length in lines) of every function and method in the file, nested ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (f"{node.name}:{node.lineno}", (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


@pytest.mark.parametrize("path", sorted(CLI.glob("*.py")), ids=lambda p: p.name)
def test_no_cli_function_is_longer_than_a_screen(path):
    long = {name: n for name, n in _functions(path) if n > MAX_FUNCTION_LINES}
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}; split them"


def test_main_only_assembles_the_parser_and_dispatches():
    lines = len((CLI / "main.py").read_text().splitlines())
    assert lines <= MAX_MAIN_LINES, f"cli/main.py has {lines} lines (at most {MAX_MAIN_LINES}): move code to its module"


def test_the_layout_test_sees_the_cli():
    assert (CLI / "main.py").is_file() and len(list(CLI.glob("*.py"))) > 5
