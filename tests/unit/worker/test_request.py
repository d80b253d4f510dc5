"""SamplingParams validation: a valid base, one mutation, the expected error."""

from __future__ import annotations

from typing import Any

import pytest

from kvrail.errors import InvalidRequestError
from kvrail.worker.engine.request import RequestStatus, SamplingParams

INVALID = [
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"max_tokens": -3}, "max_tokens"),
    ("max_tokens float", {"max_tokens": 2.5}, "max_tokens"),
    ("max_tokens bool", {"max_tokens": True}, "max_tokens"),
    ("temperature negative", {"temperature": -0.1}, "temperature"),
    ("temperature infinite", {"temperature": float("inf")}, "temperature"),
    ("temperature nan", {"temperature": float("nan")}, "temperature"),
    ("top_p zero", {"top_p": 0.0}, "top_p"),
    ("top_p above one", {"top_p": 1.5}, "top_p"),
    ("top_k negative", {"top_k": -1}, "top_k"),
    ("seed string", {"seed": "7"}, "seed"),
    ("stop integer", {"stop": 5}, "stop"),
    ("stop dict", {"stop": {"a": 1}}, "stop"),
    ("stop list with integer", {"stop": ["a", 3]}, "stop"),
    ("stop empty string", {"stop": [""]}, "stop"),
    ("stop_token_ids string", {"stop_token_ids": "12"}, "stop_token_ids"),
    ("stop_token_ids negative", {"stop_token_ids": [-1]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("case", "mutation", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_sampling_params_raise_invalid_request_error_naming_the_field(
    case: str, mutation: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**mutation)


def test_valid_sampling_params_are_normalised() -> None:
    params = SamplingParams(max_tokens=3, temperature=1, top_p=0.5, stop="x", stop_token_ids=[7])
    assert params.stop == ("x",)
    assert params.stop_token_ids == (7,)
    assert params.temperature == 1.0
    assert not params.is_greedy
    assert SamplingParams().is_greedy


def test_only_finished_statuses_have_a_finish_reason() -> None:
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {s for s in RequestStatus if s.finish_reason is not None}
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"


def test_token_ids_between_equals_slicing_all_token_ids() -> None:
    from kvrail.worker.testing import make_request

    request = make_request(5)
    request.output_token_ids.extend([1, 2, 3])
    everything = request.all_token_ids
    for start in range(9):
        for end in range(start, 9):
            assert request.token_ids_between(start, end) == everything[start:end]
