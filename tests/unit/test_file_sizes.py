"""STYLE.md §2: short files, one concept each. No Python file outside tests/ and bench/ grows
past MAX_LINES lines, except those named in ALLOWED with the reason; an entry goes once its file
is back under the limit."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
ALLOWED = {
    "kernels/skinny_gemm.py": (
        "one Triton kernel and its launcher, as every kernel module is; a fifth of it is the "
        "docstring with the measurements behind the design, and bench/ imports its "
        "configuration and heuristics from it"
    ),
}


def _sizes() -> dict[str, int]:
    """Lines of every tracked Python file outside tests/ and bench/, by path."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, capture_output=True, check=True,
        timeout=60,
    ).stdout.decode()  # fmt: skip
    paths = [p for p in listed.split("\0") if p and not p.startswith(("tests/", "bench/"))]
    assert paths, "git ls-files found no Python file"
    return {p: len((ROOT / p).read_bytes().splitlines()) for p in paths if (ROOT / p).is_file()}


def test_no_file_outside_tests_and_bench_is_over_the_line_limit() -> None:
    over = {p: n for p, n in _sizes().items() if n > MAX_LINES and p not in ALLOWED}
    assert over == {}, f"over {MAX_LINES} lines: carve them along a seam (or allow one, why)"


def test_every_file_allowed_over_the_limit_still_is() -> None:
    sizes = _sizes()
    stale = sorted(p for p in ALLOWED if sizes.get(p, 0) <= MAX_LINES)
    assert stale == [], f"under {MAX_LINES} lines now (or gone): drop them from ALLOWED"
