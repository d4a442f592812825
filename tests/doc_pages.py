"""The pages users read: README.md and docs/*.md (plain Markdown, rendered by GitHub). Snippets tagged
`<!-- tested: TAG -->` run as written in tests/e2e/test_doc_snippets.py, wherever on these pages they live."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

TAG = re.compile(r"^<!-- tested: ([\w-]+) -->", re.M)  # on a line of its own: prose may name a tag
TAGGED_BLOCK = r"^<!-- tested: {} -->\s*```\w*\n(.*?)```"


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def tags() -> dict[str, list[Path]]:
    """Every tag, with the pages that carry it (once each time it occurs)."""
    found: dict[str, list[Path]] = {}
    for page in pages():
        for tag in TAG.findall(page.read_text()):
            found.setdefault(tag, []).append(page)
    return found


def block_tagged(tag: str) -> str:
    """The code block right after `<!-- tested: TAG -->`: the tag must occur exactly once on all the pages."""
    where = tags().get(tag, [])
    assert len(where) == 1, f"tag {tag!r} must occur once in README.md and docs/*.md, found in {where}"
    match = re.search(TAGGED_BLOCK.format(re.escape(tag)), where[0].read_text(), re.S | re.M)
    assert match, f"{where[0].name}: no code block right after <!-- tested: {tag} -->"
    return match.group(1)
