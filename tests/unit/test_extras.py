"""scikit-learn and matplotlib are extras: a missing one is one line that names the pip install."""

from __future__ import annotations

import builtins
import subprocess
import sys

import pytest

from mixtrain.errors import MissingExtraError, require
from tests.conftest import REPO


def _without(monkeypatch, name: str) -> None:
    real = builtins.__import__

    def fake(module, *args, **kwargs):
        if module == name or module.startswith(name + "."):
            raise ModuleNotFoundError(f"No module named {module!r}")
        return real(module, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, loaded)


def test_a_missing_extra_names_the_pip_install(monkeypatch):
    _without(monkeypatch, "sklearn")
    from mixtrain.examples.digits import load_digits

    with pytest.raises(
        MissingExtraError, match=r'the digits example .* needs scikit-learn.*pip install "mixtrain\[examples\]"'
    ):
        load_digits()
    _without(monkeypatch, "matplotlib")
    from mixtrain.observe.report import write_report

    with pytest.raises(MissingExtraError, match=r'mixtrain report.s plots needs matplotlib.*"mixtrain\[report\]"'):
        write_report(REPO / "nowhere")
    require("json", "json", "x", "y")  # there: nothing raised


def test_the_package_requires_neither():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = " ".join(meta["dependencies"])
    assert "scikit-learn" not in required and "matplotlib" not in required
    assert meta["optional-dependencies"]["examples"] == ["scikit-learn>=1.3"]
    assert meta["optional-dependencies"]["report"] == ["matplotlib>=3.7"]


def test_the_cli_prints_one_line_for_it(tmp_path):
    code = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def fake(m, *a, **k):\n"
        "    if m == 'sklearn' or m.startswith('sklearn.'): raise ModuleNotFoundError(m)\n"
        "    return real(m, *a, **k)\n"
        "builtins.__import__ = fake\n"
        "from mixtrain.cli.main import main\n"
        "sys.exit(main(['train', 'digits', '--run-dir', sys.argv[1]]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "r")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert 'pip install "mixtrain[examples]"' in proc.stderr and "Traceback" not in proc.stderr
