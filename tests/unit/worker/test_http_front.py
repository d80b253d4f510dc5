"""The worker's ``--http-front``: checked and normalised before the record advertises it, IPv6
in brackets whether the kubelet wrote them or not (``$(KVRAIL_POD_IP):8000``)."""

from __future__ import annotations

import pytest

from kvrail.worker.__main__ import _front_address


@pytest.mark.parametrize(
    ("given", "advertised"),
    [("10.0.0.5:8000", "10.0.0.5:8000"), ("fd00::5:8000", "[fd00::5]:8000"),
     ("[fd00:0::5]:8000", "[fd00::5]:8000")],
)  # fmt: skip
def test_the_front_is_advertised_normalised(given: str, advertised: str) -> None:
    assert _front_address(given) == advertised


@pytest.mark.parametrize("given", ["pod-a:8000", "10.0.0.5", "[10.0.0.5]:8000", "fd00::5"])
def test_a_bad_front_names_the_option(given: str) -> None:
    with pytest.raises(ValueError, match="--http-front"):
        _front_address(given)
