"""vLLM's disaggregated protocol as the router speaks it: the two request bodies, the prefill's
answer, the decode stream's lines, and how a failed step is classified."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvrail.sampling import SamplingParams, TokenBias
from kvrail.vllm.protocol import (
    DONE,
    Completion,
    Delta,
    VllmProtocolError,
    decode_body,
    failure_of_status,
    kv_transfer_params_of,
    parse_sse_line,
    prefill_body,
)

REQUEST = Completion(
    "smol", (1, 2, 3), SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=11)
)
# What a vLLM 0.32 prefill server answers (abridged to the fields kvrail passes on).
PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
    "remote_engine_id": "e-1", "remote_request_id": "cmpl-x-0", "remote_host": "10.0.0.5",
    "remote_port": 5600, "tp_size": 1,
}  # fmt: skip


def chunk(**choice: Any) -> str:
    body = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "smol",
            "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None,
                         "stop_reason": None, **choice}]}  # fmt: skip
    return "data: " + json.dumps(body)


def test_the_prefill_body_asks_for_one_token_and_remote_decode_without_streaming() -> None:
    body = prefill_body(REQUEST)
    assert body == {
        "model": "smol", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.5, "top_p": 0.9,
        "seed": 11, "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        },
    }  # fmt: skip
    json.dumps(body)  # JSON as it is


def test_the_decode_body_streams_token_ids_with_the_prefills_params_or_none() -> None:
    remote = decode_body(REQUEST, PARAMS)
    assert remote["kv_transfer_params"] == PARAMS and remote["kv_transfer_params"] is not PARAMS
    assert remote["stream"] is True and remote["return_token_ids"] is True
    assert remote["max_tokens"] == 7 and remote["prompt"] == [1, 2, 3]
    local = decode_body(Completion("smol", (5,), SamplingParams(max_tokens=2)), None)
    assert "kv_transfer_params" not in local and "seed" not in local


def test_every_sampling_field_reaches_vllm_under_its_own_name_and_neutral_ones_stay_out() -> None:
    sampling = SamplingParams(
        max_tokens=9, min_tokens=3, temperature=0.7, top_k=40, min_p=0.1, stop_token_ids=(5,),
        ignore_eos=True, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.25,
        logit_bias=(TokenBias(7, -100.0),),
    )  # fmt: skip
    body = decode_body(Completion("smol", (5,), sampling), None)
    assert body["logit_bias"] == {"7": -100.0}  # vLLM's OpenAI form: string keys
    assert {k: body[k] for k in ("max_tokens", "min_tokens", "top_k", "min_p")} == {
        "max_tokens": 9, "min_tokens": 3, "top_k": 40, "min_p": 0.1,
    }  # fmt: skip
    assert body["stop_token_ids"] == [5] and body["ignore_eos"] is True
    assert (body["repetition_penalty"], body["presence_penalty"]) == (1.1, 0.5)
    assert body["frequency_penalty"] == 0.25
    prefill = prefill_body(Completion("smol", (5,), sampling))
    assert (prefill["max_tokens"], prefill["min_tokens"]) == (1, 1)
    plain = decode_body(Completion("smol", (5,), SamplingParams(max_tokens=2)), None)
    assert not {"min_tokens", "top_k", "min_p", "stop_token_ids", "ignore_eos", "logit_bias"} & set(
        plain
    )


def test_a_completion_without_a_prompt_or_model_is_refused() -> None:
    cases = [({"prompt_token_ids": ()}, "prompt"), ({"model": ""}, "model name")]
    for kwargs, problem in cases:
        values: dict[str, Any] = {
            "model": "m", "prompt_token_ids": (1,), "sampling": SamplingParams(max_tokens=1)
        }  # fmt: skip
        with pytest.raises(ValueError, match=problem):
            Completion(**(values | kwargs))


def test_the_prefills_kv_transfer_params_pass_unchanged_and_their_absence_is_an_error() -> None:
    answer = {"id": "cmpl-1", "choices": [{"text": "x"}], "kv_transfer_params": PARAMS}
    assert kv_transfer_params_of(answer) == PARAMS
    for bad in ([], {"choices": []}, {"kv_transfer_params": None}, {"kv_transfer_params": "x"}):
        with pytest.raises(VllmProtocolError) as err:
            kv_transfer_params_of(bad)
        assert err.value.code == "malformed"


def test_stream_lines_become_token_deltas_a_finish_reason_and_done() -> None:
    assert parse_sse_line(chunk(token_ids=[5, 6], prompt_token_ids=[1, 2, 3])) == Delta((5, 6))
    assert parse_sse_line(chunk(token_ids=[7], finish_reason="length")) == Delta((7,), "length")
    assert parse_sse_line(chunk(token_ids=[], finish_reason="stop")) == Delta((), "stop")
    usage = {"id": "c", "object": "text_completion", "created": 1, "model": "smol",
             "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}  # fmt: skip
    assert parse_sse_line("data: " + json.dumps(usage)) == Delta()
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line('data:{"choices": []}') == Delta()  # the space is optional


def test_lines_that_carry_nothing_are_skipped() -> None:
    for line in ("", ": keep-alive", "event: message", "id: 4", "retry: 100"):
        assert parse_sse_line(line) is None


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("data: {not json", "not valid JSON"),
        ("data: [1, 2]", "not a JSON object"),
        ("data:", "not valid JSON"),
        ('data: {"id": "c"}', "no choices list"),
        ('data: {"choices": [{}, {}]}', "exactly one choice"),
        ('data: {"choices": [{"text": "secret prompt"}]}', "no token_ids"),
        ('data: {"choices": [{"token_ids": null}]}', "no token_ids"),
        ('data: {"choices": [{"token_ids": [1, -2]}]}', "not ids"),
        ('data: {"choices": [{"token_ids": [1.5]}]}', "not ids"),
        ('data: {"choices": [{"token_ids": [true]}]}', "not ids"),
        ('data: {"choices": [{"token_ids": [], "finish_reason": "a b"}]}', "not a word"),
    ],
)
def test_a_malformed_chunk_is_a_clear_error_that_quotes_nothing(line: str, problem: str) -> None:
    with pytest.raises(VllmProtocolError, match=problem) as err:
        parse_sse_line(line)
    assert err.value.code == "malformed"
    assert "secret" not in str(err.value)


def test_an_error_in_the_stream_is_an_engine_error_without_its_message() -> None:
    for body in ({"error": {"message": "secret prompt", "code": 500}},
                 {"object": "error", "message": "secret prompt"}):  # fmt: skip
        with pytest.raises(VllmProtocolError) as err:
            parse_sse_line("data: " + json.dumps(body))
        assert err.value.code == "engine_error" and "secret" not in str(err.value)


@pytest.mark.parametrize(
    ("status", "failure"),
    [(400, "invalid_request"), (413, "invalid_request"), (422, "invalid_request"),
     (404, "unavailable"), (429, "unavailable"), (500, "unavailable"), (503, "unavailable")],
)  # fmt: skip
def test_refused_input_is_the_clients_error_and_anything_else_the_servers(
    status: int, failure: str
) -> None:
    assert failure_of_status(status) == failure


def test_a_success_status_is_not_a_failure() -> None:
    with pytest.raises(ValueError, match="not a failure"):
        failure_of_status(200)
