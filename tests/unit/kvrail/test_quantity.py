"""Kubernetes quantities read as the API server reads them, and byte counts written back."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvrail.crd.quantity import format_bytes, parse_quantity, quantity_bytes


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("16Gi", 16 * 2**30), ("500M", 500 * 10**6), ("1e9", 10**9), ("1.5Gi", 3 * 2**29),
        ("250m", Fraction(1, 4)), (".5Ki", 512), ("0", 0), ("-2k", -2000), (1024, 1024),
        ("1E3", 1000), ("3Ei", 3 * 2**60),
    ],
)  # fmt: skip
def test_parse_quantity_reads_suffixes_and_exponents_exactly(
    text: int | str, value: Fraction | int
) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1 Gi", "1gi", "1.2.3", "1e99", "0x10", True])
def test_parse_quantity_refuses_what_is_not_a_quantity(text: object) -> None:
    with pytest.raises(ValueError, match=r"quantity|range"):
        parse_quantity(text)  # type: ignore[arg-type]


def test_quantity_bytes_rounds_up_to_whole_bytes() -> None:
    assert quantity_bytes("1500m") == 2
    assert quantity_bytes("0.1k") == 100


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(64 * 2**30, "64Gi"), (1536 * 2**20, "1536Mi"), (1000, "1000"), (0, "0"), (2**50, "1Pi")],
)
def test_format_bytes_writes_the_shortest_exact_binary_quantity(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text
    assert quantity_bytes(text) == num_bytes
