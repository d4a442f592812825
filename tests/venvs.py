"""Real second virtual environments for tests, made in a second: a fresh venv that sees some of this
environment's installed packages (chosen by `keep`, given each distribution's canonical name), linked into
one folder that a .pth file puts on its path. Nothing is downloaded or copied but what the caller adds."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from packaging.utils import canonicalize_name


def linked_venv(root: Path, keep: Callable[[str], bool], name: str = "venv") -> tuple[Path, Path]:
    """(the venv's python, the linked folder on its path): put extra packages in that folder to add them."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / name)], check=True)
    shim = root / f"{name}-site"
    shim.mkdir()
    for dist in importlib.metadata.distributions():
        if not keep(canonicalize_name(dist.metadata["Name"])):
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts}:
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            src = Path(str(dist.locate_file(top)))
            if src.exists() and not (shim / top).exists():
                (shim / top).symlink_to(src)
    site = next((root / name / "lib").glob("python*/site-packages"))
    (site / "linked.pth").write_text(f"{shim}\n")
    return root / name / "bin" / "python", shim
