"""The per-token chunk written from its template equals the chunk built in full."""

from __future__ import annotations

import json

import pytest

from kvrail.router.api.streaming import Reply, _event

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
def test_the_text_events_template_writes_the_same_bytes_as_the_full_chunk(
    kind: str, include_usage: bool
) -> None:
    reply = Reply(kind, "chatcmpl-1", 'model "x"', 1_733_000_000, 12, include_usage)  # type: ignore[arg-type]
    for text in TEXTS:
        assert reply.text_event(text) == _event(reply.chunk(text, None)), text
        body = json.loads(reply.text_event(text).removeprefix(b"data: "))
        got = (
            body["choices"][0]["delta"]["content"] if kind == "chat" else body["choices"][0]["text"]
        )
        assert got == text
