"""Kubernetes resource quantities (`16Gi`, `500M`, `1e9`, `250m`) as exact numbers, and back.

The operator adds byte counts to the memory and storage a role asks for (a KV tier's bytes to
the worker's memory), so it reads quantities the way the API server does: decimal (`k`, `M`,
`G`, `T`, `P`, `E`) and binary (`Ki` to `Ei`) suffixes, milli (`m`) and exponents, rounded up to
whole units where a whole number is needed.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Final

_DECIMAL: Final = {"k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY: Final = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_SUFFIXES: Final[dict[str, Fraction]] = {
    "": Fraction(1),
    "m": Fraction(1, 1000),
    **{suffix: Fraction(10**power) for suffix, power in _DECIMAL.items()},
    **{suffix: Fraction(2**power) for suffix, power in _BINARY.items()},
}
_QUANTITY = re.compile(
    r"^(?P<sign>[+-]?)(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)|[eE](?P<exp>[+-]?[0-9]+))?$"
)
BYTES_PATTERN: Final = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
"""A non-negative byte size (no milli, no exponent, no sign): what a KV tier's `size` may be.
Every string it matches is a valid quantity (the CRD's pattern)."""


def parse_quantity(value: int | str) -> Fraction:
    """The exact value of a quantity. Raises ValueError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return Fraction(value)
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 16Gi, 500M, 1e9)")
    number = Fraction(match["number"])
    if match["exp"] is not None:
        exponent = int(match["exp"])
        if abs(exponent) > 30:
            raise ValueError(f"{value!r} is out of range")
        number *= Fraction(10) ** exponent
    else:
        number *= _SUFFIXES[match["suffix"] or ""]
    return -number if match["sign"] == "-" else number


def quantity_bytes(value: int | str) -> int:
    """A byte quantity as whole bytes, rounded up (as the API server rounds memory)."""
    return math.ceil(parse_quantity(value))


def format_bytes(num_bytes: int) -> str:
    """Whole bytes as the shortest exact binary quantity: `64Gi`, `1536Mi`, `1000`."""
    if num_bytes < 0:
        raise ValueError(f"a byte count cannot be negative: {num_bytes}")
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIXES[suffix])
        if num_bytes and num_bytes % unit == 0:
            return f"{num_bytes // unit}{suffix}"
    return str(num_bytes)
