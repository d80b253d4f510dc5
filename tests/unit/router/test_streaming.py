"""The per-token chunk written from its template equals the chunk built in full, and a stream
leaves in one write per piece, its end in one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from kvrail.router.api.errors import ApiError
from kvrail.router.api.streaming import EventStream, Piece, Reply, _event, sse

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
