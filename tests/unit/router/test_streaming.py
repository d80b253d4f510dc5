"""The per-token chunk written from its template equals the chunk built in full, a stream
leaves in one write per piece, its end in one, and a request that asked for logprobs gets
every token's in OpenAI's shapes (parsed by the `openai` client's types)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk
from openai.types.completion_choice import Logprobs as OpenAICompletionLogprobs

from kvrail.outputs import RequestOutput, TokenLogprobs
from kvrail.router.api import responses
from kvrail.router.api.errors import ApiError
from kvrail.router.api.streaming import EventStream, Piece, Reply, _event, collect, sse
from kvrail.router.output.piece import ToolCallDelta

TEXTS = [
    "",
    " Paris",
    'quote " and \\ backslash',
    "tab\t newline\n",
    "日本語 😀",
    "\x00\x1f",
    "\u2028",
]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("served_name", ['model "x"', "SmolLM2-135M-Instruct", "modèle\\日本"])
def test_the_chunk_templates_write_the_same_bytes_as_the_full_chunk(
    kind: str, include_usage: bool, served_name: str
) -> None:
    for response_id, created in (("chatcmpl-1", 1_733_000_000), ('odd "id" \u2028', 0)):
        reply = Reply(kind, response_id, served_name, created, 12, include_usage)  # type: ignore[arg-type]
        for text in TEXTS:
            assert reply.text_event(text) == _event(reply.chunk(text, None)), text
            body = json.loads(reply.text_event(text).removeprefix(b"data: "))
            choice = body["choices"][0]
            assert (choice["delta"]["content"] if kind == "chat" else choice["text"]) == text
        if kind == "chat":
            assert reply.role_event() == _event(reply.chunk("", None, first=True))
        for finish in ("stop", "length"):
            assert reply.finish_event(finish) == _event(reply.chunk(None, finish))
        for piece in (Piece("", None, 0), Piece("x", "length", 7, num_cached_tokens=3)):
            usage = reply.usage(piece)
            assert reply.usage_event(usage) == _event(reply.chunk(None, None, usage=usage))


def test_a_model_name_equal_to_a_template_hole_is_refused() -> None:
    reply = Reply("chat", "chatcmpl-1", "\ue000kvrail-value\ue001", 1, 3)
    with pytest.raises(ValueError, match="model name"):
        reply.text_event("x")


async def _written(reply: Reply, pieces: list[Piece], fail: ApiError | None = None) -> list[Any]:
    """The ASGI messages an `EventStream` of `sse` sends for `pieces` (then `fail`, if given)."""

    async def gen() -> AsyncGenerator[Piece, None]:
        for piece in pieces:
            yield piece
        if fail is not None:
            raise fail

    sent: list[Any] = []
    statuses: list[str] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        await asyncio.Event().wait()  # the client never leaves

    stream = EventStream(sse(reply, gen(), statuses.append), lambda: None, reply.response_id)
    await stream({"type": "http"}, receive, send)
    assert statuses == (["200"] if fail is None else [str(fail.status)])
    return sent


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_stream_sends_one_write_per_piece_and_its_end_in_one(include_usage: bool) -> None:
    reply = Reply("chat", "chatcmpl-1", "m", 1_733_000_000, 5, include_usage)
    pieces = [Piece("Hel", None, 1), Piece("", None, 2), Piece("lo", "length", 3)]
    sent = asyncio.run(_written(reply, pieces))
    start, role, hel, end = sent  # the empty piece writes nothing
    assert start["type"] == "http.response.start"
    assert (b"x-request-id", b"chatcmpl-1") in start["headers"]
    assert role["body"] == _event(reply.chunk("", None, first=True)) and role["more_body"]
    assert hel["body"] == reply.text_event("Hel") and hel["more_body"]
    tail = reply.text_event("lo") + _event(reply.chunk(None, "length"))
    if include_usage:
        tail += _event(reply.chunk(None, None, usage=reply.usage(pieces[-1])))
    assert end["body"] == tail + b"data: [DONE]\n\n" and not end["more_body"]


def test_an_error_mid_stream_is_sent_with_the_end() -> None:
    reply = Reply("completion", "cmpl-1", "m", 1_733_000_000, 5)
    failure = ApiError(503, "no worker", "server_error", code="no_worker")
    sent = asyncio.run(_written(reply, [Piece("Hel", None, 1)], failure))
    assert [m["body"] for m in sent[1:]] == [
        reply.text_event("Hel"),
        _event(failure.body()) + b"data: [DONE]\n\n",
    ]
    assert not sent[-1]["more_body"]


# -- logprobs -------------------------------------------------------------------------------------

TOKEN_TEXTS = {1: " Paris", 2: " is", 3: "\ufffd", 4: "\ufffd", 5: "<|im_end|>", 6: " Lyon"}


def output(*token_ids: int) -> RequestOutput:
    """An output record whose tokens each carry logprobs, with two most likely tokens."""
    logprobs = tuple(TokenLogprobs(t, -0.5, (t, 6), (-0.5, -2.0)) for t in token_ids)
    return RequestOutput("r", token_ids, logprobs=logprobs)


# " Paris", " is", then a character over two tokens (no text until both came), "!" from the
# flush with no token, the end token: the pieces `generate` makes of them.
LOGPROB_PIECES = [
    Piece(" Paris", None, 1, 0, output(1)),
    Piece(" is", None, 2, 0, output(2)),
    Piece("", None, 3, 0, output(3)),
    Piece(" é", None, 4, 0, output(4)),
    Piece("!", "stop", 5, 0, output(5)),
]


async def _pieces(pieces: list[Piece]) -> AsyncGenerator[Piece, None]:
    for piece in pieces:
        yield piece


def _events(chunks: list[bytes]) -> list[dict[str, Any]]:
    body = b"".join(chunks).decode()
    assert body.endswith("data: [DONE]\n\n")
    events = body.removesuffix("data: [DONE]\n\n").split("\n\n")[:-1]
    return [json.loads(e.removeprefix("data: ")) for e in events]


async def _streamed(reply: Reply, pieces: list[Piece]) -> list[dict[str, Any]]:
    return _events([chunk async for chunk in sse(reply, _pieces(pieces), lambda _: None)])


def _reply(kind: str, every: bool = False, asked: bool = True) -> Reply:
    token_text = TOKEN_TEXTS.__getitem__ if asked else None
    return Reply(kind, "id-1", "m", 1_733_000_000, 5, every, every, token_text)  # type: ignore[arg-type]


@pytest.mark.parametrize("every", [False, True])
def test_a_streamed_chat_sends_each_pieces_tokens_logprobs_in_its_chunk(every: bool) -> None:
    events = asyncio.run(_streamed(_reply("chat", every), LOGPROB_PIECES))
    for event in events:
        OpenAIChatCompletionChunk.model_validate(event)
    role, *texts, finish = [e for e in events if e["choices"]]
    assert role["choices"][0]["logprobs"] is None and finish["choices"][0]["logprobs"] is None
    assert [t["choices"][0]["delta"]["content"] for t in texts] == [
        " Paris", " is", "", " é", "!"
    ]  # a piece with tokens and no text is sent too  # fmt: skip
    tokens = [[e["token"] for e in t["choices"][0]["logprobs"]["content"]] for t in texts]
    assert tokens == [[" Paris"], [" is"], ["\ufffd"], ["\ufffd"], ["<|im_end|>"]]
    entry = texts[0]["choices"][0]["logprobs"]
    assert entry == {"content": [{
        "token": " Paris", "logprob": -0.5, "bytes": list(b" Paris"),
        "top_logprobs": [{"token": " Paris", "logprob": -0.5, "bytes": list(b" Paris")},
                         {"token": " Lyon", "logprob": -2.0, "bytes": list(b" Lyon")}],
    }]}  # fmt: skip
    assert all(("usage" in t and t["usage"] is not None) == every for t in texts)


def test_a_streamed_completions_offsets_continue_across_chunks() -> None:
    events = asyncio.run(_streamed(_reply("completion"), LOGPROB_PIECES))
    texts = [e["choices"][0] for e in events if e["choices"][0]["logprobs"] is not None]
    for text in texts:  # the client's type wants a finish reason in every chunk: its logprobs
        OpenAICompletionLogprobs.model_validate(text["logprobs"])
    OpenAICompletion.model_validate(events[-1])
    assert "".join(t["text"] for t in texts) == " Paris is é!"
    assert [t["logprobs"]["text_offset"] for t in texts] == [[0], [6], [9], [9], [11]]
    assert texts[0]["logprobs"]["top_logprobs"] == [{" Paris": -0.5, " Lyon": -2.0}]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_whole_body_gathers_the_logprobs_of_every_piece() -> None:
    chat = asyncio.run(collect(_pieces(LOGPROB_PIECES), _reply("chat")))
    choice = OpenAIChatCompletion.model_validate(chat).choices[0]
    assert choice.message.content == " Paris is é!" and choice.logprobs is not None
    assert choice.logprobs.content is not None and len(choice.logprobs.content) == 5
    assert chat["choices"][0]["logprobs"]["refusal"] is None
    completion = asyncio.run(collect(_pieces(LOGPROB_PIECES), _reply("completion")))
    logprobs = OpenAICompletion.model_validate(completion).choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.text_offset == [0, 6, 9, 9, 11] and len(logprobs.tokens) == 5
    assert logprobs.token_logprobs == [-0.5] * 5


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("every", [False, True])
def test_a_request_that_did_not_ask_gets_the_same_bytes_and_null_logprobs(
    kind: str, every: bool
) -> None:
    """Even when its records carried logprobs: the template chunks, as before logprobs."""
    reply = _reply(kind, every, asked=False)
    plain = [Piece(p.text, p.finish_reason, p.num_tokens) for p in LOGPROB_PIECES]

    async def streamed(pieces: list[Piece]) -> list[bytes]:
        return [chunk async for chunk in sse(reply, _pieces(pieces), lambda _: None)]

    written = asyncio.run(streamed(LOGPROB_PIECES))
    assert written == asyncio.run(streamed(plain))
    if not every:
        assert reply.text_event(" Paris") in written[1 if kind == "chat" else 0]
    assert all(e["choices"][0]["logprobs"] is None for e in _events(written) if e["choices"])
    whole = asyncio.run(collect(_pieces(LOGPROB_PIECES), _reply(kind, asked=False)))
    assert whole["choices"][0]["logprobs"] is None
    assert whole == asyncio.run(collect(_pieces(plain), _reply(kind, asked=False)))


PARSED = [
    Piece("", None, 1, reasoning="Let me "),
    Piece("", None, 2, reasoning="check."),
    Piece("Sure.", None, 3, tool_calls=(ToolCallDelta(0, "call_a", "get_weather", '{"ci'),)),
    Piece("", None, 4, tool_calls=(ToolCallDelta(0, arguments='ty": "Oslo"}'),
                                   ToolCallDelta(1, "call_b", "now", "{}"))),
    Piece("", "tool_calls", 5),
]  # fmt: skip


@pytest.mark.parametrize("logprobs", [False, True])
def test_reasoning_and_tool_calls_stream_as_openai_deltas_and_join_into_the_whole_body(
    logprobs: bool,
) -> None:
    output = RequestOutput("r", (7,), logprobs=(TokenLogprobs(7, -0.5),))
    pieces = [dataclasses.replace(p, output=output) for p in PARSED]
    reply = Reply("chat", "chatcmpl-1", "m", 1, 5, token_text=(lambda _: "x") if logprobs else None,
                  reasoning=True)  # fmt: skip
    sent = asyncio.run(_written(reply, pieces))
    events = b"".join(m.get("body", b"") for m in sent[1:]).split(b"\n\n")
    chunks = [OpenAIChatCompletionChunk.model_validate_json(e.removeprefix(b"data: "))
              for e in events if e.startswith(b"data: {")]  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me check."
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Let me check."
    assert "".join(d.content or "" for d in deltas) == "Sure."
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert [(t.index, t.id, t.type) for t in calls] == [
        (0, "call_a", "function"), (0, None, None), (1, "call_b", "function"),
    ]  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    if logprobs:  # every piece's token, once, in its first chunk
        entries = [
            e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or ()
        ]
        assert len(entries) == len(pieces)
    whole = OpenAIChatCompletion.model_validate(asyncio.run(collect(_gen(pieces), reply)))
    message = whole.choices[0].message
    assert message.content == "Sure." and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()] == [
        ("call_a", "get_weather", '{"city": "Oslo"}'), ("call_b", "now", "{}"),
    ]  # fmt: skip
    assert getattr(message, "reasoning_content", None) == "Let me check."
    assert getattr(message, "reasoning", None) == "Let me check."


def test_a_message_with_only_calls_has_null_content_and_no_thinking_is_null() -> None:
    reply = Reply("chat", "chatcmpl-1", "m", 1, 5, reasoning=True)
    pieces = [Piece("", "tool_calls", 1, tool_calls=(ToolCallDelta(0, "call_a", "f", "{}"),))]
    body = asyncio.run(collect(_gen(pieces), reply))
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] is None
    _roundtrip = responses.ChatCompletion.model_validate(body).model_dump(mode="json")
    assert _roundtrip["choices"][0]["message"]["tool_calls"] == message["tool_calls"]
    plain = asyncio.run(collect(_gen([Piece("hi", "stop", 1)]), Reply("chat", "c", "m", 1, 5)))
    assert set(plain["choices"][0]["message"]) == {"role", "content", "refusal"}


async def _gen(pieces: list[Piece]) -> AsyncGenerator[Piece, None]:
    for piece in pieces:
        yield piece
