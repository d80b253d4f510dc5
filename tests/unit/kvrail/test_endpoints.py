"""kvrail.endpoints: GAIE endpoint strings, IPv4 and IPv6, as the worker writes them into its
record and the endpoint picker reads them, names them to the gateway and matches subset hints."""

from __future__ import annotations

import pytest

from kvrail.endpoints import endpoint_ip, normalise_hint, parse_endpoint


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10.0.0.1:8000", "10.0.0.1:8000"), (" 10.0.0.1:080 ", "10.0.0.1:80"),
     ("[fd00::1]:8000", "[fd00::1]:8000"), ("[FD00:0:0::1]:08000", "[fd00::1]:8000"),
     # the kubelet's `$(KVRAIL_POD_IP):8000` on an IPv6 pod: the last colon is the port's
     ("fd00::1:8000", "[fd00::1]:8000"), ("fd00:0:0:0:0:0:0:1:8000", "[fd00::1]:8000"),
     ("[::1]:9002", "[::1]:9002"), ("[::ffff:10.0.0.1]:80", "[::ffff:a00:1]:80")],
)  # fmt: skip
def test_endpoints_are_normalised_with_ipv6_in_brackets(text: str, expected: str) -> None:
    assert parse_endpoint(text) == expected
    assert parse_endpoint(expected) == expected  # normalised once is normalised


@pytest.mark.parametrize(
    ("text", "problem"),
    [("10.0.0.1", "not ip:port"), ("pod-a:8000", "IP address"), ("10.0.0.1:0", "port"),
     ("[fd00::1]", "port"), ("[fd00::1]:", "port"), ("fd00::1", "IP address"),
     ("[10.0.0.1]:8000", "only an IPv6"), ("[pod-a]:8000", "IP address"), (":8000", "ip:port")],
)  # fmt: skip
def test_bad_endpoints_are_refused_naming_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_endpoint(text)


def test_the_address_of_an_endpoint_has_no_brackets() -> None:
    assert endpoint_ip("[fd00::1]:8000") == "fd00::1"
    assert endpoint_ip("10.0.0.1:8000") == "10.0.0.1"


@pytest.mark.parametrize(
    ("item", "expected"),
    [("10.0.0.1:8000", "10.0.0.1:8000"), ("10.0.0.1", "10.0.0.1"),
     ("[fd00::1]:8000", "[fd00::1]:8000"), ("[fd00:0::1]:8000", "[fd00::1]:8000"),
     ("fd00:0::1", "fd00::1"), ("[fd00::1]", "fd00::1"), (" fd00::1 ", "fd00::1"),
     # unbracketed, a whole IPv6 address is an address: a gateway brackets one with a port
     ("fd00::1:8000", "fd00::1:8000"), ("pod-a:80", "pod-a:80")],
)  # fmt: skip
def test_subset_hint_entries_compare_with_normalised_endpoints(item: str, expected: str) -> None:
    assert normalise_hint(item) == expected
