"""`TransportFaults`: a fraction of writes fails, or loses its notification, at a fixed spacing
(the first, then every `1 / fraction`-th), so a short window always sees its fault."""

from __future__ import annotations

from typing import Any, cast

import pytest

from kvrail.errors import TransferError
from kvrail.worker.transfer.blocks import TransferStats
from kvrail.worker.transfer.connector import Connector
from kvrail.worker.transfer.faults import TransportFaults


class Recorder:
    def __init__(self) -> None:
        self.notes: list[bytes] = []

    def write(self, _peer: str, _src: Any, _dst: Any, note: bytes, _deadline: float) -> Any:
        self.notes.append(note)
        return TransferStats(100, 0.01, "nixl-ucx")


def outcomes(faults: TransportFaults, n: int) -> list[str]:
    conn = Recorder()
    out = []
    for i in range(n):
        try:
            faults.write(cast(Connector, conn), f"r-{i}", "peer", [1], [2], b"done", 1e12)
        except TransferError:
            out.append("failed")
        else:
            out.append("written" if conn.notes[-1] else "lost")
    return out


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [
        (0.0, ["written"] * 6),
        (0.5, ["failed", "written"] * 3),
        (1 / 3, ["failed", "written", "written"] * 2),
        (1.0, ["failed"] * 6),
    ],
)
def test_a_fraction_of_writes_fails_the_first_then_evenly(
    fraction: float, expected: list[str]
) -> None:
    assert outcomes(TransportFaults(fail=fraction), 6) == expected


def test_lost_notifications_are_spaced_alike_and_counted_apart_from_failures() -> None:
    both = TransportFaults(fail=0.5, lose_notification=0.5)
    # writes 1, 3, 5 fail; of the writes that went (2, 4, 6), the first and third lose theirs
    assert outcomes(both, 6) == ["failed", "lost", "failed", "written", "failed", "lost"]


def test_the_delay_counts_in_the_writes_seconds() -> None:
    stats = TransportFaults(delay_s=0.02).write(
        cast(Connector, Recorder()), "r", "peer", [1], [2], b"done", 1e12
    )
    assert stats.seconds == pytest.approx(0.03)
