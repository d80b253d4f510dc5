"""kvrail.epp.picker.LeastInFlight: its order, its limits and its bookings per stream."""

from __future__ import annotations

import pytest

from kvrail.epp.picker import LeastInFlight, NoEndpoint, PickRequest, Routed, Shed

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def request(stream_id: int, eligible: frozenset[str] | None = None) -> PickRequest:
    return PickRequest(stream_id, {}, b"{}", eligible)


async def test_the_least_busy_endpoint_leads_and_the_rest_follow() -> None:
    picker = LeastInFlight([A, B, C])
    assert await picker.pick(request(1)) == Routed((A, B, C))
    assert await picker.pick(request(2)) == Routed((B, C, A))
    assert await picker.pick(request(3)) == Routed((C, A, B))
    picker.finished(2)
    assert await picker.pick(request(4)) == Routed((B, A, C))
    assert picker.in_flight == {A: 1, B: 1, C: 1}


async def test_finishing_releases_once_and_unknown_streams_are_ignored() -> None:
    picker = LeastInFlight([A, B])
    await picker.pick(request(1))
    picker.finished(1)
    picker.finished(1)
    picker.finished(99)
    assert picker.in_flight == {A: 0, B: 0}


async def test_a_stream_picked_twice_holds_one_booking() -> None:
    picker = LeastInFlight([A, B])
    await picker.pick(request(1))
    await picker.pick(request(1))
    assert sum(picker.in_flight.values()) == 1


async def test_the_booking_follows_the_served_endpoint() -> None:
    picker = LeastInFlight([A, B])
    await picker.pick(request(1))
    picker.served(1, B)
    assert picker.in_flight == {A: 0, B: 1}
    picker.served(1, "10.9.9.9:1")  # not ours: ignored
    picker.served(7, A)  # no booking: ignored
    assert picker.in_flight == {A: 0, B: 1}
    picker.finished(1)
    assert picker.in_flight == {A: 0, B: 0}


async def test_the_subset_hint_limits_the_choice_by_address_or_ip() -> None:
    picker = LeastInFlight([A, B, C])
    assert await picker.pick(request(1, frozenset({C}))) == Routed((C,))
    assert await picker.pick(request(2, frozenset({"10.0.0.2", A}))) == Routed((A, B))
    assert isinstance(await picker.pick(request(3, frozenset())), NoEndpoint)
    assert isinstance(await picker.pick(request(4, frozenset({"10.0.0.9:8000"}))), NoEndpoint)
    assert picker.in_flight == {A: 1, B: 0, C: 1}


async def test_ipv6_endpoints_match_the_subset_hint_by_endpoint_or_bare_address() -> None:
    v6a, v6b = "[fd00::1]:8000", "[fd00::2]:8000"
    picker = LeastInFlight(["fd00:0::1:8000", v6b])  # normalised as the record's fronts are
    assert picker.endpoints == (v6a, v6b)
    assert await picker.pick(request(1, frozenset({"fd00::2"}))) == Routed((v6b,))
    assert await picker.pick(request(2, frozenset({v6a}))) == Routed((v6a,))
    # The bracketed address alone is no endpoint form: hints arrive normalised (protocol).
    assert isinstance(await picker.pick(request(3, frozenset({"[fd00::1]"}))), NoEndpoint)


async def test_full_endpoints_are_skipped_then_the_request_is_shed() -> None:
    picker = LeastInFlight([A, B], max_in_flight=1)
    assert await picker.pick(request(1)) == Routed((A, B))
    assert await picker.pick(request(2)) == Routed((B,))
    assert isinstance(await picker.pick(request(3)), Shed)
    assert picker.in_flight == {A: 1, B: 1}


def test_a_picker_needs_distinct_endpoints_and_a_positive_limit() -> None:
    with pytest.raises(ValueError, match="at least one"):
        LeastInFlight([])
    with pytest.raises(ValueError, match="twice"):
        LeastInFlight([A, "10.0.0.1:08000"])
    with pytest.raises(ValueError, match="max_in_flight"):
        LeastInFlight([A], max_in_flight=0)
