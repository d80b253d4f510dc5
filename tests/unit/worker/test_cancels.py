"""`RecentCancels`: cancels remembered for a TTL, in bounded memory.

How the roles use it (a cancel that overtakes its request) runs against real processes in
tests/integration/test_worker_disaggregated.py.
"""

from __future__ import annotations

import pytest

from kvrail.worker.roles.cancels import RecentCancels


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_cancel_is_remembered_until_its_ttl_passes() -> None:
    clock = Clock()
    cancels = RecentCancels(ttl_s=60.0, clock=clock)
    assert "r-1" not in cancels
    cancels.add("r-1")
    assert "r-1" in cancels
    assert "r-2" not in cancels
    clock.now += 59.9
    assert "r-1" in cancels
    clock.now += 0.1
    assert "r-1" not in cancels
    assert len(cancels) == 0


def test_expired_ids_are_dropped_as_new_ones_arrive() -> None:
    clock = Clock()
    cancels = RecentCancels(ttl_s=10.0, clock=clock)
    for i in range(5):
        cancels.add(f"old-{i}")
    clock.now += 10.0
    cancels.add("new")
    assert len(cancels._expiry) == 1  # the old ones are gone, not merely hidden
    assert "new" in cancels


def test_a_repeated_cancel_renews_its_ttl_and_its_place() -> None:
    clock = Clock()
    cancels = RecentCancels(ttl_s=10.0, max_size=2, clock=clock)
    cancels.add("a")
    clock.now += 5.0
    cancels.add("b")
    cancels.add("a")  # renewed: now the newest, expires at +15
    cancels.add("c")  # evicts "b", the oldest
    assert "b" not in cancels
    assert "a" in cancels
    assert "c" in cancels
    clock.now += 9.0  # +14: the first "a" would have expired
    assert "a" in cancels
    clock.now += 1.0
    assert "a" not in cancels


def test_a_flood_of_cancels_keeps_only_the_newest() -> None:
    clock = Clock()
    cancels = RecentCancels(ttl_s=600.0, max_size=100, clock=clock)
    for i in range(10_000):
        cancels.add(f"bogus-{i}")
    assert len(cancels) == 100
    assert "bogus-0" not in cancels
    assert "bogus-9899" not in cancels
    assert all(f"bogus-{i}" in cancels for i in range(9900, 10_000))


def test_only_strings_are_members() -> None:
    cancels = RecentCancels(ttl_s=1.0)
    cancels.add("1")
    assert 1 not in cancels
    assert "1" in cancels


@pytest.mark.parametrize(("ttl_s", "max_size"), [(0.0, 10), (-1.0, 10), (1.0, 0)])
def test_a_useless_memory_is_refused(ttl_s: float, max_size: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        RecentCancels(ttl_s=ttl_s, max_size=max_size)
