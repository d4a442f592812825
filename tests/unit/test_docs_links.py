"""README.md and docs/*.md: every relative link and #anchor resolves, every tested snippet's tag occurs once, and
the README stays a front door. GitHub renders these pages; nothing else builds them, so this is their check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.doc_pages import TAGGED_BLOCK, pages, tags

README_MAX_LINES = 320
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code spans removed (a link inside either is not a link)."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lowercase, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "")).lower()
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's slug; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text().split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not heading:
            continue
        base = slug(heading.group(1))
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    problems = []
    for line in prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                problems.append(f"{page.name}: {target}: {path} does not exist")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{page.name}: {target}: no heading in {resolved.name} has the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page) == []


def test_the_readme_is_a_front_door():
    lines = len(pages()[0].read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the detail into a guide under docs/"


def test_every_tested_snippet_is_tagged_once_and_is_a_code_block():
    found = tags()
    assert {"own-code", "own-loop", "keep-workers", "sliced-loop"} <= set(
        found
    )  # the tags tests/e2e/test_doc_snippets.py runs
    for tag, where in found.items():
        assert len(where) == 1, f"tag {tag!r} occurs {len(where)} times: {[p.name for p in where]}"
        assert re.search(TAGGED_BLOCK.format(re.escape(tag)), where[0].read_text(), re.S | re.M), tag


def test_the_checker_reads_anchors_as_github_does(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A `mixtrain plan` run: 2 workers\n## MacBook + NVIDIA desktop\n## Notes\n## Notes\n"
        "```\n# not a heading\n[not a link](missing.md)\n```\n"
        "[ok](#a-mixtrain-plan-run-2-workers) [ok](#macbook--nvidia-desktop) [ok](#notes-1) [bad](#notes-2)"
        " [bad](gone.md) [ok](page.md#notes) `[code](gone.md)` [ext](https://example.org/x#y)\n"
    )
    assert broken_links(page) == [
        "page.md: #notes-2: no heading in page.md has the anchor #notes-2",
        "page.md: gone.md: gone.md does not exist",
    ]
