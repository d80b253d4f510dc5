"""SamplingParams validation (a valid base, one mutation, the expected error) and its wire form."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from kvrail.codec import MessageError, decode
from kvrail.errors import InvalidRequestError
from kvrail.messages import GenerateRequest
from kvrail.sampling import SamplingParams, TokenBias

BASE = SamplingParams(max_tokens=8)
INVALID = [
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"max_tokens": -3}, "max_tokens"),
    ("max_tokens float", {"max_tokens": 2.5}, "max_tokens"),
    ("max_tokens bool", {"max_tokens": True}, "max_tokens"),
    ("min_tokens above max_tokens", {"min_tokens": 9}, "min_tokens"),
    ("min_tokens negative", {"min_tokens": -1}, "min_tokens"),
    ("temperature negative", {"temperature": -0.1}, "temperature"),
    ("temperature infinite", {"temperature": float("inf")}, "temperature"),
    ("temperature nan", {"temperature": float("nan")}, "temperature"),
    ("top_p zero", {"top_p": 0.0}, "top_p"),
    ("top_p above one", {"top_p": 1.5}, "top_p"),
    ("top_k negative", {"top_k": -1}, "top_k"),
    ("min_p above one", {"min_p": 1.5}, "min_p"),
    ("seed string", {"seed": "7"}, "seed"),
    ("stop_token_ids a list", {"stop_token_ids": [12]}, "stop_token_ids"),
    ("stop_token_ids negative", {"stop_token_ids": (-1,)}, "stop_token_ids"),
    ("stop_token_ids too many", {"stop_token_ids": tuple(range(65))}, "stop_token_ids"),
    ("ignore_eos not a bool", {"ignore_eos": 1}, "ignore_eos"),
    ("repetition_penalty zero", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("presence_penalty above 2", {"presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty below -2", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("logit_bias a dict", {"logit_bias": {5: 1.0}}, "logit_bias"),
    ("logit_bias above 100", {"logit_bias": (TokenBias(5, 100.5),)}, "logit_bias"),
    ("logit_bias not finite", {"logit_bias": (TokenBias(5, float("nan")),)}, "logit_bias"),
    ("logit_bias negative id", {"logit_bias": (TokenBias(-5, 1.0),)}, "logit_bias"),
    (
        "logit_bias an id twice",
        {"logit_bias": (TokenBias(5, 1.0), TokenBias(5, 2.0))},
        "logit_bias",
    ),
    (
        "logit_bias too many",
        {"logit_bias": tuple(TokenBias(i, 1.0) for i in range(301))},
        "logit_bias",
    ),
]


@pytest.mark.parametrize(("case", "mutation", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_sampling_params_raise_invalid_request_error_naming_the_field(
    case: str, mutation: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        replace(BASE, **mutation)


def test_valid_sampling_params_are_normalised() -> None:
    params = SamplingParams(max_tokens=3, temperature=1, top_p=0.5, stop_token_ids=(7,))
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    assert not params.is_greedy and not params.has_penalties
    assert BASE.is_greedy
    assert replace(BASE, repetition_penalty=1.1).has_penalties
    assert replace(BASE, frequency_penalty=-0.5).has_penalties


def _request(sampling: SamplingParams) -> GenerateRequest:
    return GenerateRequest("r-1", (1, 2, 3), "_INBOX.abc", 2e9, sampling)


def test_sampling_params_travel_inside_a_generate_request_unchanged() -> None:
    sampling = SamplingParams(
        max_tokens=9, min_tokens=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=-3,
        stop_token_ids=(5, 6), ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.5,
        frequency_penalty=-0.25, logit_bias=(TokenBias(7, -100.0), TokenBias(9, 2.5)),
    )  # fmt: skip
    assert decode(_request(sampling).encode(), GenerateRequest).sampling == sampling


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 8, "top_k": -1}, "top_k"),
        ({"max_tokens": 8, "temperature": None}, "temperature"),
        ({"unknown": 1, "max_tokens": 8}, None),
        ([{"max_tokens": 8}], "sampling must be an object"),
        ({}, "lacks field max_tokens"),
    ],
)
def test_a_hostile_sampling_object_is_a_message_error_or_ignored(
    sampling: Any, message: str | None
) -> None:
    body = json.loads(_request(BASE).encode())
    body["sampling"] = sampling
    data = json.dumps(body).encode()
    if message is None:  # an unknown field is ignored, as in every message
        assert decode(data, GenerateRequest).sampling == BASE
        return
    with pytest.raises(MessageError, match=message):
        decode(data, GenerateRequest)
