"""README snippets run exactly as written."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def readme_block(tag: str) -> str:
    """The first code block after `<!-- tested: TAG -->` in README.md."""
    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- tested: {tag} -->\s*```\w*\n(.*?)```", text, re.S)
    assert match, f"README.md has no block tagged {tag}"
    return match.group(1)


def test_your_own_training_code_script_trains_as_written(tmp_path):
    (tmp_path / "own_code.py").write_text(readme_block("own-code"))
    proc = subprocess.run(
        [sys.executable, "own_code.py"], capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = float(re.search(r"held-out accuracy (\d\.\d+)", proc.stdout).group(1))
    assert accuracy > 0.9, proc.stdout  # a linear model cannot pass 0.5 on this XOR-shaped task
