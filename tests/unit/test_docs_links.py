"""Every relative link in README.md, docs/ and bench/ resolves: the file or folder it names exists,
and a `#fragment` into a markdown file names one of its headings (GitHub's anchors)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").rglob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
_EXTERNAL = ("http://", "https://", "mailto:")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`,
    repeats numbered."""
    text = _FENCE.sub("", page.read_text())
    seen: Counter[str] = Counter()
    out = set()
    for heading in _HEADING.findall(text):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return out


def links(page: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", page.read_text()))
    return [t for t in _LINK.findall(text) if not t.startswith(_EXTERNAL)]


def broken(page: Path) -> list[str]:
    out = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{target}: {dest} does not exist")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            out.append(f"{target}: {dest} has no heading #{fragment}")
    return out


def test_the_pages_are_found() -> None:
    assert ROOT / "README.md" in PAGES and ROOT / "bench" / "README.md" in PAGES


def test_anchors_follow_githubs_rules() -> None:
    page = ROOT / "docs" / "benchmarks.md"
    assert "the-load-generator" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []
