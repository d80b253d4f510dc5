"""Logprobs in OpenAI's shapes (`router/api/logprobs.py`), checked against the `openai`
client's own types."""

from __future__ import annotations

from typing import Any

from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk
from pydantic import BaseModel

from kvrail.outputs import TokenLogprobs
from kvrail.router.api import responses
from kvrail.router.api.logprobs import (
    MIN_LOGPROB,
    ResponseLogprobs,
    chat_content,
    completion_lists,
)

TEXTS = {1: " Paris", 2: " Lyon", 3: "<|im_end|>", 4: "\ufffd", 5: "é", 6: " Nice"}
token_text = TEXTS.__getitem__


def sampled(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprobs:
    """A sampled token's record with its most likely tokens (`top`, most likely first)."""
    return TokenLogprobs(token_id, logprob, tuple(t for t, _ in top), tuple(v for _, v in top))


PARIS = sampled(1, -0.25, (1, -0.25), (2, -1.5))
END = sampled(3, -0.01, (3, -0.01), (6, -5.0))
UNLIKELY = sampled(6, -4.0, (1, -0.5), (2, -1.0))  # sampled outside the top 2


def test_a_chat_entry_names_the_token_its_bytes_and_the_most_likely_in_order() -> None:
    assert chat_content([PARIS, sampled(5, -2.0)], token_text) == [
        {
            "token": " Paris", "logprob": -0.25, "bytes": [32, 80, 97, 114, 105, 115],
            "top_logprobs": [
                {"token": " Paris", "logprob": -0.25, "bytes": [32, 80, 97, 114, 105, 115]},
                {"token": " Lyon", "logprob": -1.5, "bytes": [32, 76, 121, 111, 110]},
            ],
        },
        {"token": "é", "logprob": -2.0, "bytes": [0xC3, 0xA9], "top_logprobs": []},
    ]  # fmt: skip


def test_a_completion_lists_tokens_values_the_top_with_the_sampled_one_and_offsets() -> None:
    lists = completion_lists([PARIS, UNLIKELY, END], token_text, text_offset=7)
    assert lists == {
        "tokens": [" Paris", " Nice", "<|im_end|>"],
        "token_logprobs": [-0.25, -4.0, -0.01],
        "top_logprobs": [
            {" Paris": -0.25, " Lyon": -1.5},
            {" Paris": -0.5, " Lyon": -1.0, " Nice": -4.0},  # OpenAI: up to logprobs + 1
            {"<|im_end|>": -0.01, " Nice": -5.0},
        ],
        "text_offset": [7, 13, 18],
    }
    zero = completion_lists([sampled(2, -3.0)], token_text, 0)  # logprobs: 0
    assert zero["top_logprobs"] == [{" Lyon": -3.0}]


def test_two_ids_of_one_text_keep_the_likelier_and_minus_infinity_is_written_finite() -> None:
    split = sampled(4, float("-inf"), (4, float("-inf")), (4, -1.0))
    assert completion_lists([split], token_text, 0)["top_logprobs"] == [{"\ufffd": MIN_LOGPROB}]
    entry = chat_content([sampled(1, float("nan"))], token_text)[0]
    assert entry["logprob"] == MIN_LOGPROB


def test_a_completions_offsets_start_where_each_pieces_text_starts() -> None:
    """Anchored to the returned text: a piece whose tokens returned no text yet (a character
    split over tokens, text held back for a stop string) moves no later offset."""
    logprobs = ResponseLogprobs(is_chat=False, token_text=token_text)
    first = logprobs.of([PARIS], " Paris")
    held = logprobs.of([sampled(4, -1.0)], "")
    assert logprobs.of([], " and") is None  # text without tokens still counts
    last = logprobs.of([sampled(2, -1.0), END], " Lyon")
    parts = [first, held, None, last]
    assert [p["text_offset"] for p in parts if p is not None] == [[0], [6], [10, 15]]
    whole = logprobs.join(parts)
    assert whole["tokens"] == [" Paris", "\ufffd", " Lyon", "<|im_end|>"]
    assert whole["text_offset"] == [0, 6, 10, 15]
    body = responses.completion("cmpl-1", "m", 1, " Paris and Lyon", "stop",
                                responses.usage(3, 4), logprobs=whole)  # fmt: skip
    parsed = OpenAICompletion.model_validate(body).choices[0].logprobs
    assert parsed is not None and parsed.top_logprobs is not None
    assert parsed.text_offset == [0, 6, 10, 15] and parsed.top_logprobs[0][" Lyon"] == -1.5
    _roundtrip(responses.Completion, body)


def _roundtrip(model: type[BaseModel], body: dict[str, Any]) -> None:
    """`body` has exactly the fields of our response model (the OpenAPI schema's)."""
    assert model.model_validate(body).model_dump(mode="json", exclude_unset=True) == body


def test_a_chat_body_joins_the_pieces_entries_and_parses_as_openais() -> None:
    logprobs = ResponseLogprobs(is_chat=True, token_text=token_text)
    parts = [logprobs.of([PARIS], " Paris"), logprobs.of([], "!"), logprobs.of([END], "")]
    whole = logprobs.join(parts)
    assert whole["refusal"] is None
    assert [e["token"] for e in whole["content"]] == [" Paris", "<|im_end|>"]
    body = responses.chat_completion("chatcmpl-1", "m", 1, " Paris!", "stop",
                                     responses.usage(3, 2), logprobs=whole)  # fmt: skip
    choice = OpenAIChatCompletion.model_validate(body).choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert choice.logprobs.content[0].top_logprobs[1].token == " Lyon"
    assert choice.logprobs.content[0].bytes == list(b" Paris")
    _roundtrip(responses.ChatCompletion, body)
    chunk = responses.chat_chunk("chatcmpl-1", "m", 1, " Paris", logprobs=parts[0])
    assert parts[0] == {"content": whole["content"][:1]}  # a chunk's: no refusal
    parsed = OpenAIChatCompletionChunk.model_validate(chunk).choices[0].logprobs
    assert parsed is not None and parsed.content is not None and parsed.content[0].logprob == -0.25
    _roundtrip(responses.ChatCompletionChunk, chunk)


def test_an_echoed_prompt_leads_with_a_null_first_token_and_its_scored_tokens() -> None:
    """lm-eval reads `token_logprobs[ctxlen:]`: the prompt's tokens come first, the first with
    null (nothing precedes it), then the prompt's scores, then the sampled tokens."""
    logprobs = ResponseLogprobs(is_chat=False, token_text=token_text)
    prompt = [sampled(6, -3.0, (1, -0.5))]  # " Nice" scored after " Paris"
    first = logprobs.of([sampled(2, -1.0, (2, -1.0))], " Paris Nice Lyon", echo=(1,),
                        prompt=prompt)  # fmt: skip
    assert first is not None
    assert first["tokens"] == [" Paris", " Nice", " Lyon"]
    assert first["token_logprobs"] == [None, -3.0, -1.0]
    assert first["top_logprobs"] == [None, {" Paris": -0.5, " Nice": -3.0}, {" Lyon": -1.0}]
    assert first["text_offset"] == [0, 6, 11]
    body = responses.completion("cmpl-1", "m", 1, " Paris Nice Lyon", "length",
                                responses.usage(2, 1), logprobs=logprobs.join([first]))  # fmt: skip
    # The `openai` package types `token_logprobs` as floats only, though OpenAI's API writes
    # null for an echoed prompt's first token (and the client does not validate what it reads).
    _roundtrip(responses.Completion, body)
