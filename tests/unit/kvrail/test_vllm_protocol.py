"""vLLM's disaggregated protocol as the router speaks it: the two request bodies, the sampling
fields carried or refused, the prefill's answer, the decode stream's lines (their logprobs too),
and how a failed step is classified."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from typing import Any

import llguidance
import pytest

from kvrail.outputs import TokenLogprobs
from kvrail.sampling import SamplingParams, TokenBias
from kvrail.vllm.protocol import (
    CARRIED,
    DONE,
    Completion,
    Delta,
    VllmProtocolError,
    decode_body,
    failure_of_status,
    kv_transfer_params_of,
    lark_of,
    parse_sse_line,
    prefill_body,
    uncarried,
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


# One value other than the neutral one for every carried field.
NON_NEUTRAL: dict[str, Any] = {
    "max_tokens": 3, "min_tokens": 1, "temperature": 0.7, "top_p": 0.5, "top_k": 4,
    "min_p": 0.2, "seed": 1, "stop_token_ids": (9,), "ignore_eos": True,
    "repetition_penalty": 1.2, "presence_penalty": 0.1, "frequency_penalty": 0.1,
    "logit_bias": (TokenBias(3, 5.0),), "logprobs": 0, "grammar": 'start: "yes" | "no"',
}  # fmt: skip


def test_each_carried_field_changes_what_vllm_is_sent_and_names_a_sampling_field() -> None:
    assert set(NON_NEUTRAL) == CARRIED
    assert {f.name for f in fields(SamplingParams)} >= CARRIED
    plain = SamplingParams(max_tokens=2)
    neutral = decode_body(Completion("smol", (5,), plain), None)
    for name, value in NON_NEUTRAL.items():
        body = decode_body(Completion("smol", (5,), replace(plain, **{name: value})), None)
        assert body != neutral, f"{name} does not reach vLLM"


def test_a_field_outside_carried_is_refused_by_name_only_when_set() -> None:
    plain = SamplingParams(max_tokens=2)
    everything = SamplingParams(**{n: v for n, v in NON_NEUTRAL.items()})
    assert uncarried(plain) is None and uncarried(everything) is None
    fewer = CARRIED - {"logprobs", "seed"}
    assert uncarried(plain, fewer) is None  # left at their defaults: nothing to refuse
    assert uncarried(replace(plain, logprobs=0), fewer) == "logprobs"  # 0 is not the default
    assert uncarried(replace(plain, seed=4), fewer) == "seed"
    assert uncarried(plain, CARRIED - {"max_tokens"}) == "max_tokens"  # required: always set


def test_logprobs_are_asked_of_the_decode_server_by_token_id_and_never_of_the_prefill() -> None:
    asked = Completion("smol", (5,), SamplingParams(max_tokens=4, logprobs=0))
    decode = decode_body(asked, PARAMS)
    assert decode["logprobs"] == 0 and decode["return_tokens_as_token_ids"] is True
    prefill = prefill_body(asked)
    assert not {"logprobs", "return_tokens_as_token_ids"} & set(prefill)
    plain = decode_body(REQUEST, PARAMS)
    assert not {"logprobs", "return_tokens_as_token_ids"} & set(plain)


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


def lp_chunk(
    token_ids: list[int], *items: tuple[float, list[tuple[int, float]]], **extra: Any
) -> str:
    """A chunk as vLLM writes it under `return_tokens_as_token_ids`: per token, its logprob and
    its `top_logprobs` entries (id, logprob) in vLLM's order."""
    logprobs = {
        "text_offset": list(range(len(token_ids))),
        "tokens": [f"token_id:{t}" for t in token_ids],
        "token_logprobs": [value for value, _ in items],
        "top_logprobs": [{f"token_id:{i}": v for i, v in top} for _, top in items],
    }
    return chunk(token_ids=token_ids, logprobs=logprobs, **extra)


def test_logprobs_become_the_sampled_token_and_the_k_most_likely_most_likely_first() -> None:
    # k = 2. Token 7 is not among the two most likely (3 entries: itself first, then the two);
    # token 4 is the second most likely (2 entries: itself first, then the first); token 6 is
    # the first (greedy).
    line = lp_chunk(
        [7, 4, 6],
        (-3.0, [(7, -3.0), (1, -0.5), (2, -1.0)]),
        (-1.0, [(4, -1.0), (9, -0.25)]),
        (-0.1, [(6, -0.1), (8, -2.5)]),
    )  # fmt: skip
    assert parse_sse_line(line, 2) == Delta(
        (7, 4, 6), None, (
            TokenLogprobs(7, -3.0, (1, 2), (-0.5, -1.0)),
            TokenLogprobs(4, -1.0, (9, 4), (-0.25, -1.0)),
            TokenLogprobs(6, -0.1, (6, 8), (-0.1, -2.5)),
        ),
    )  # fmt: skip
    zero = parse_sse_line(lp_chunk([5], (-0.5, [(5, -0.5)])), 0)  # logprobs: 0
    assert zero == Delta((5,), None, (TokenLogprobs(5, -0.5),))
    tie = parse_sse_line(lp_chunk([5], (-1.0, [(5, -1.0), (3, -1.0)])), 2)
    assert isinstance(tie, Delta) and tie.logprobs[0].top_token_ids == (5, 3)  # vLLM's rank
    assert parse_sse_line(lp_chunk([5], (-0.5, [(5, -0.5)]))) == Delta((5,))  # not asked: unread


def test_a_chunk_without_tokens_needs_no_logprobs() -> None:
    assert parse_sse_line(chunk(token_ids=[], finish_reason="stop"), 3) == Delta((), "stop")
    assert parse_sse_line(lp_chunk([], finish_reason="length"), 3) == Delta((), "length")


@pytest.mark.parametrize(
    ("logprobs", "problem"),
    [
        (None, "no logprobs object"),
        ({"tokens": ["token_id:5"], "token_logprobs": [-1.0]}, "do not match"),
        ({"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-1.0],
          "top_logprobs": [{}]}, "do not match"),
        ({"tokens": [" secret"], "token_logprobs": [-1.0],
          "top_logprobs": [{"token_id:5": -1.0}]}, "does not name its token id"),
        ({"tokens": ["token_id:6"], "token_logprobs": [-1.0],
          "top_logprobs": [{"token_id:6": -1.0}]}, "does not name its token id"),
        ({"tokens": ["token_id:5"], "token_logprobs": ["-1"],
          "top_logprobs": [{"token_id:5": -1.0, "token_id:3": -0.5}]}, "not a number"),
        ({"tokens": ["token_id:5"], "token_logprobs": [-1.0],
          "top_logprobs": [{"token_id:5": True}]}, "not a number"),
        ({"tokens": ["token_id:5"], "token_logprobs": [-1.0],
          "top_logprobs": [{" secret": -1.0}]}, "token_id:<id>"),
        ({"tokens": ["token_id:5"], "token_logprobs": [-1.0],
          "top_logprobs": [{"token_id:٣": -1.0}]}, "token_id:<id>"),
        ({"tokens": ["token_id:5"], "token_logprobs": [-1.0],
          "top_logprobs": [[-1.0]]}, "not an object"),
        ({"tokens": ["token_id:5"], "token_logprobs": [-1.0],
          "top_logprobs": [{"token_id:3": -0.5, "token_id:5": -1.0}]}, "the top k"),
        ({"tokens": ["token_id:5"], "token_logprobs": [-1.0],
          "top_logprobs": [{"token_id:5": -1.0}]}, "the top k"),  # k = 2: 2 or 3 entries
        ({"tokens": ["token_id:5"], "token_logprobs": [-1.0],
          "top_logprobs": [{"token_id:5": -1.0, "token_id:3": -2.0, "token_id:4": -0.5}]},
         "rank order"),
    ],
)  # fmt: skip
def test_malformed_logprobs_are_a_clear_error_that_quotes_nothing(
    logprobs: object, problem: str
) -> None:
    with pytest.raises(VllmProtocolError, match=problem) as err:
        parse_sse_line(chunk(token_ids=[5], logprobs=logprobs), 2)
    assert err.value.code == "malformed" and "secret" not in str(err.value)


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


def test_a_grammar_reaches_the_decode_server_as_lark_for_vllms_llguidance_and_not_the_prefill():
    lark = 'start: "<tool_call>" %json{"type": "object"} "</tool_call>"'
    asked = Completion("smol", (5,), SamplingParams(max_tokens=4, grammar=lark))
    assert decode_body(asked, PARAMS)["structured_outputs"] == {"grammar": lark}
    assert "structured_outputs" not in prefill_body(asked)  # its one token is discarded
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    compact = {"whitespace_flexible": False}
    top = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=compact)
    as_lark = lark_of(top)
    assert as_lark.startswith("start: %json{")
    assert json.loads(as_lark.removeprefix("start: %json")) == {**schema, "x-guidance": compact}
    assert llguidance.LLMatcher.validate_grammar_with_warnings(as_lark) == (False, [])


def test_a_grammar_vllm_would_read_differently_is_refused_by_name() -> None:
    two = json.dumps({"grammars": [{"lark_grammar": "start: a"}, {"lark_grammar": "start: b"}]})
    bounded = json.dumps({"grammars": [{"lark_grammar": "start: a"}], "max_tokens": 3})
    for grammar in (two, bounded, "{not json"):
        with pytest.raises(VllmProtocolError) as err:
            lark_of(grammar)
        assert err.value.code == "unsupported"
        assert uncarried(SamplingParams(max_tokens=2, grammar=grammar)) == "grammar"
    assert uncarried(SamplingParams(max_tokens=2, grammar="start: /a+/")) is None
