"""The digest that tells the check whether its bundle was built from the source tree it runs in."""

from __future__ import annotations

import hashlib
from pathlib import Path


def source_digest(repo: Path) -> str:
    """SHA-256 over mixtrain's source files under repo/src (paths and contents): equal digests, equal code."""
    h = hashlib.sha256()
    root = repo / "src"
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel or ".egg-info" in rel:
            continue
        h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
