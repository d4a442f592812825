"""docs/architecture.md's floors hold for the code (issue 47): every room of src/mixtrain (a folder, or a file at
the top) is on the table, and every module-level import goes to a room on a lower floor. Imports inside a function
(a lazy import, such as job.py reaching the trainer) and under TYPE_CHECKING are not arrows. No import of mixtrain."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "mixtrain"

DOC = ROOT / "docs" / "architecture.md"


def floors() -> dict[str, int]:
    """The table between the floors markers: room -> floor."""
    text = DOC.read_text()
    table = text[text.index("<!-- floors -->") : text.index("<!-- /floors -->")]
    out: dict[str, int] = {}
    for line in table.splitlines():
        found = re.match(r"\|\s*(\d+)\s*\|(.*)\|", line)
        if found:
            for room in re.findall(r"`([^`]+)`", found.group(2)):
                assert room not in out, f"{room} is on two floors"
                out[room.rstrip("/")] = int(found.group(1))
    return out


def room_of(module: str) -> str | None:
    """mixtrain.driver.controller -> driver; mixtrain.config -> config; mixtrain -> None (the package's face)."""
    parts = module.split(".")[1:]
    return parts[0] if parts else None


def rooms() -> set[str]:
    return {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {
        p.stem for p in SRC.glob("*.py") if p.name != "__init__.py"
    }


def module_imports(path: Path, src: Path = SRC) -> list[tuple[int, str]]:
    """(line, module) of each import of mixtrain at module level (also inside a top-level if/try/with)."""
    module = ".".join(path.relative_to(src.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.extend((node.lineno, a.name) for a in node.names if a.name.startswith("mixtrain."))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                if base == "mixtrain":  # from mixtrain import x: x is the room
                    found.extend((node.lineno, f"mixtrain.{a.name}") for a in node.names)
                elif base.startswith("mixtrain."):
                    found.append((node.lineno, base))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                handlers = [h for handler in getattr(node, "handlers", []) for h in handler.body]
                visit(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []) + handlers)

    visit(ast.parse(path.read_text()).body)
    return found


def test_every_room_is_on_the_table_and_the_table_names_no_room_that_is_gone():
    table = floors()
    assert rooms() - set(table) == set(), "a room not on docs/architecture.md's floors: put it on one"
    assert set(table) - rooms() == set(), "docs/architecture.md names a room that is gone"


def upward_imports(src: Path, table: dict[str, int]) -> list[str]:
    out = []
    for path in sorted(src.rglob("*.py")):
        here = room_of(".".join(path.relative_to(src.parent).with_suffix("").parts))
        if here is None or here == "__init__":
            continue
        for line, module in module_imports(path, src):
            there = room_of(module)
            if there is not None and there != here and table[there] >= table[here]:
                out.append(f"{path.relative_to(src.parent)}:{line} imports {module} ({there} on floor {table[there]})")
    return out


def test_every_module_level_import_goes_down_a_floor():
    upward = upward_imports(SRC, floors())
    assert upward == [], "\n".join(upward)


def test_the_check_catches_an_import_up_and_passes_lazy_ones(tmp_path):
    src = tmp_path / "mixtrain"
    for name, text in {
        "records/__init__.py": "",
        "records/messages.py": "from mixtrain.driver.controller import Controller\n",  # up: caught
        "driver/__init__.py": "",
        "driver/controller.py": "from mixtrain.records import messages\n\ndef f():\n    import mixtrain.cli\n",
        "job.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mixtrain.driver import controller\n",
    }.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    table = {"driver": 11, "records": 7, "job": 3, "cli": 13}
    assert upward_imports(src, table) == ["mixtrain/records/messages.py:1 imports mixtrain.driver.controller "
                                          "(driver on floor 11)"]  # fmt: skip


def test_every_file_the_map_names_exists():
    text = DOC.read_text()
    named = set(re.findall(r"`((?:[\w.]+/)*\w+\.py)`", text))
    everywhere = {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    gone = []
    for name in sorted(named):
        if "/" not in name:
            found = name in everywhere
        else:
            found = any((base / name).is_file() for base in (ROOT, SRC, SRC.parent))
        if not found:
            gone.append(name)
    assert len(named) > 40 and gone == [], gone


def longer_than(kinds: tuple[type, ...], limit: int) -> list[str]:
    """Definitions of `kinds` (functions, classes) in the package over `limit` lines."""
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kinds):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return long


def test_no_function_in_the_package_is_over_60_lines():
    assert longer_than((ast.FunctionDef, ast.AsyncFunctionDef), 60) == []


def test_no_class_in_the_package_is_over_300_lines():
    assert longer_than((ast.ClassDef,), 300) == []


def test_no_room_holds_over_15_percent_of_the_package():
    lines: dict[str, int] = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).parts
        if len(parts) > 1:  # the top-level files are no room
            lines[parts[0]] = lines.get(parts[0], 0) + len(path.read_text().splitlines())
    total = sum(len(p.read_text().splitlines()) for p in SRC.rglob("*.py"))
    over = {room: f"{n / total:.1%}" for room, n in lines.items() if n > 0.15 * total}
    assert over == {}, over
