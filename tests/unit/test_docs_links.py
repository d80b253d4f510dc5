"""Every relative link in README.md, docs/ and bench/ resolves: the file or folder it names exists,
and a `#fragment` into a markdown file names one of its headings (GitHub's anchors). Every
`bench/...` path a Python file outside bench/ names (in its comments and docstrings) exists."""

from __future__ import annotations

import re
import subprocess
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
_BENCH_PATH = re.compile(r"\bbench/[\w./-]*")
_PATTERN_CHARS = "*{<"  # right after a path: a glob or a template, not one file


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


def bench_paths(text: str) -> list[str]:
    """The `bench/...` paths `text` names, without a sentence's closing `.`; a glob or a
    template (`bench/x/results-*.json`, `bench/x/{a,b}`, `bench/x/<name>`) is left out."""
    out = []
    for match in _BENCH_PATH.finditer(text):
        if text[match.end() : match.end() + 1] in tuple(_PATTERN_CHARS):
            continue
        out.append(match.group().rstrip("."))
    return out


def test_bench_paths_leave_out_globs_and_a_closing_full_stop() -> None:
    text = "see bench/studies/gemm/pdl_chain.txt. Also bench/transfer/results-*.json, bench/x/<y>"
    assert bench_paths(text) == ["bench/studies/gemm/pdl_chain.txt"]


def test_every_bench_path_named_outside_bench_exists() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, capture_output=True, check=True,
        timeout=60,
    ).stdout.decode()  # fmt: skip
    sources = [p for p in listed.split("\0") if p and not p.startswith("bench/")]
    assert sources, "git ls-files found no Python file"
    missing = [
        f"{source}: {path}"
        for source in sources
        if (ROOT / source).is_file()
        for path in bench_paths((ROOT / source).read_text())
        if not (ROOT / path).exists()
    ]
    assert missing == [], "moved or removed: name where it is now, or the commit that had it"
