"""How a request's text pieces reach its client: server-sent events or one JSON body.

`generate.serve` yields `Piece`s (text, its finish reason on the last, the output tokens so far,
the prompt tokens served from the prefix cache, the engine's output record); `Reply` builds the
OpenAI-shaped bodies from them. Streamed, `sse` sends a chat response's first chunk with the
role, a chunk per piece with text, one with the finish reason, the usage chunk when
`stream_options.include_usage` asks (and usage in every chunk when `continuous_usage_stats`
does), and always ends with `data: [DONE]`; an error while streaming is sent before it as an
event in OpenAI's error shape. A request that asked for logprobs gets its tokens' in the chunk
of their piece (sent for a piece with tokens and no text too). A piece with reasoning or tool
calls (`kvrail.router.output`) makes a chunk each for its reasoning (`reasoning_content` and
`reasoning`), its text and its calls (`tool_calls` deltas); plain text keeps the fast
templates. `EventStream` (`event_stream`) closes the pieces
however the response ends, so a client that disconnects (before the first byte included)
cancels the request on every worker at once. Not streamed, `collect` joins the pieces (and
their logprobs) and `until_disconnect` cancels them if the client leaves meanwhile. Every
response is counted in `kvrail_requests_total` with its status (499 for a client that left
mid-stream).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from kvrail.codec import compact_json
from kvrail.router.api import responses
from kvrail.router.api.errors import ApiError
from kvrail.router.api.event_stream import REQUEST_ID_HEADER, EventStream, Last, until_disconnect
from kvrail.router.api.logprobs import ResponseLogprobs, TokenText
from kvrail.router.output.piece import Piece, ToolCallDelta

Kind = Literal["chat", "completion"]
Choice = tuple[str, str, dict[str, Any] | None, str | None, Sequence[ToolCallDelta]]
"""A whole choice: its text, finish reason, logprobs (None: not asked), reasoning (None: no
reasoning parser) and tool calls."""
__all__ = [
    "REQUEST_ID_HEADER", "EventStream", "Last", "Piece", "Reply", "collect", "sse",
    "until_disconnect",
]  # fmt: skip


@dataclass(slots=True)
class Reply:
    """Builds the OpenAI-shaped bodies of one response; `created` is when it was created.

    The chunks a stream always sends (role, text, finish, usage) are written from templates
    (`_template`, made once per process for each model name, kind and usage option, with holes
    for the response's id, `created` and the chunk's one value): the same bytes as the dict built
    and serialized in full, at a fraction of the cost (`tests/unit/router/test_streaming.py`
    holds the two equal). A text chunk is sent per token, the others once per response.

    `token_text` is given when the request asked for logprobs: its text chunks are then built
    in full (`logprobs_event`), with the logprobs of their tokens. So are the chunks of a piece
    with reasoning or tool calls (`parsed_events`); `reasoning` says a whole message has the
    reasoning fields (the router's reasoning parser is on).
    """

    kind: Kind
    response_id: str
    served_name: str
    created: int
    num_prompt_tokens: int
    include_usage: bool = False
    continuous_usage_stats: bool = False
    token_text: TokenText | None = None
    num_choices: int = 1
    reasoning: bool = False
    _logprobs: dict[int, ResponseLogprobs] = field(default_factory=dict)
    """Each choice's logprobs as far as they were rendered (`logprobs_of`)."""
    _known: tuple[bytes, bytes] = field(init=False)
    """The response id and `created` as they are written in a chunk."""
    _bound: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    """Per shape: the chunk's bytes before and after its value, for this response."""

    def __post_init__(self) -> None:
        self._known = (json.dumps(self.response_id).encode(), str(self.created).encode())

    @property
    def asks_logprobs(self) -> bool:
        return self.token_text is not None

    def logprobs_of(self, piece: Piece) -> dict[str, Any] | None:
        """The `logprobs` of a piece's choice for its tokens (see `ResponseLogprobs.of`); a
        request that asked for them only."""
        assert self.token_text is not None
        logprobs = self._logprobs.get(piece.index)
        if logprobs is None:
            logprobs = self._logprobs[piece.index] = ResponseLogprobs(
                self.kind == "chat", self.token_text
            )
        output = piece.output
        if output is None:
            return logprobs.of((), piece.text, piece.echo)
        return logprobs.of(output.logprobs, piece.text, piece.echo, output.prompt_logprobs)

    def joined_logprobs(self, parts: Sequence[dict[str, Any] | None]) -> Any:
        """A choice's whole `logprobs` from its pieces' (`logprobs_of`), None if not asked."""
        if self.token_text is None:
            return None
        return ResponseLogprobs(self.kind == "chat", self.token_text).join(parts)

    def role_event(self, index: int = 0) -> bytes:
        """A chat choice's first chunk: the role, with empty content (no usage in it)."""
        if index:
            return _event(self.chunk("", None, first=True, index=index))
        return self._fill("role", b"")

    def text_event(self, text: str, index: int = 0) -> bytes:
        """`data: <the chunk carrying text only>` and its blank line, as `_event` would write it."""
        if index:
            return _event(self.chunk(text, None, index=index))
        return self._fill("text", json.dumps(text).encode())

    def finish_event(self, finish_reason: str, index: int = 0) -> bytes:
        """The chunk with the finish reason and an empty delta (no usage in it)."""
        if index:
            return _event(self.chunk(None, finish_reason, index=index))
        return self._fill("finish", json.dumps(finish_reason).encode())

    def usage_event(self, usage: dict[str, Any]) -> bytes:
        """The usage chunk (no choices)."""
        return self._fill("usage", compact_json(usage).encode())

    def logprobs_event(self, piece: Piece, usage: dict[str, Any] | None) -> bytes:
        """A piece's text chunk, with its tokens' logprobs (a request that asked for them; a
        piece with tokens is sent even without text, so that none of them is missing)."""
        logprobs = self.logprobs_of(piece)
        if logprobs is None and not piece.text:
            return b""
        return _event(self.chunk(piece.text, None, usage, logprobs=logprobs, index=piece.index))

    def parsed_events(self, piece: Piece, usage: dict[str, Any] | None) -> bytes:
        """A piece's chunks when it has reasoning or tool calls: one for its reasoning, one for
        its text, one for its calls, in that order (the first with the logprobs of its tokens,
        when the request asked)."""
        deltas: list[dict[str, Any]] = []
        if piece.reasoning:
            deltas.append({"reasoning_content": piece.reasoning, "reasoning": piece.reasoning})
        if piece.text:
            deltas.append({"content": piece.text})
        if piece.tool_calls:
            calls = [responses.tool_call_delta(d) for d in piece.tool_calls]
            deltas.append({"tool_calls": calls})
        logprobs = self.logprobs_of(piece) if self.token_text is not None else None
        events = [
            _event(self.chunk(None, None, usage, logprobs=logprobs if i == 0 else None,
                              index=piece.index, delta=delta))
            for i, delta in enumerate(deltas)
        ]  # fmt: skip
        return b"".join(events)

    def _fill(self, shape: _Shape, value: bytes) -> bytes:
        bound = self._bound.get(shape)
        if bound is None:  # this response's id and `created` put in the shape's template
            before_id, before_created, before_value, after_value = _template(
                self.kind, self.served_name, self.include_usage, shape
            )
            rid, created = self._known
            bound = (before_id + rid + before_created + created + before_value, after_value)
            self._bound[shape] = bound
        return bound[0] + value + bound[1]

    def usage(self, piece: Piece, others: int = 0) -> dict[str, Any]:
        """Usage as of `piece` (and `others`: the tokens of the other choices so far; the prompt
        counts once), with the prompt tokens the prefix cache served (vLLM's
        `prompt_tokens_details.cached_tokens`: the first choice's)."""
        return responses.usage(
            self.num_prompt_tokens, piece.num_tokens + others, piece.num_cached_tokens
        )

    def whole(self, choices: Sequence[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        """The whole body, its choices in the order given (their index is their place)."""
        chat = self.kind == "chat"
        build = responses.chat_completion if chat else responses.completion
        body = build(self.response_id, self.served_name, self.created, "", "stop", usage)
        body["choices"] = [
            responses.chat_choice(i, text, finish, logprobs, reasoning, calls) if chat
            else responses.completion_choice(i, text, finish, logprobs)
            for i, (text, finish, logprobs, reasoning, calls) in enumerate(choices)
        ]  # fmt: skip
        return body

    def chunk(
        self, text: str | None, finish: str | None, usage: dict[str, Any] | None = None,
        first: bool = False, logprobs: dict[str, Any] | None = None, index: int = 0,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        rid, name, created, usage_null = (
            self.response_id, self.served_name, self.created, self.include_usage
        )  # fmt: skip
        if self.kind == "chat":
            return responses.chat_chunk(
                rid, name, created, text, first, finish, usage, include_usage=usage_null,
                logprobs=logprobs, index=index, delta=delta,
            )  # fmt: skip
        return responses.completion_chunk(
            rid, name, created, text, finish, usage, include_usage=usage_null, logprobs=logprobs,
            index=index,
        )  # fmt: skip


async def collect(
    pieces: AsyncGenerator[Piece, None], reply: Reply, keep: int | None = None
) -> dict[str, Any]:
    """The whole body: each choice's text, finish reason and logprobs (when the request asked),
    and the usage of all of them. `keep` (`best_of`): the body lists only the `keep` choices
    whose tokens are likeliest on average (by their outputs' logprobs), likeliest first."""
    n = reply.num_choices
    texts: list[list[str]] = [[] for _ in range(n)]
    reasonings: list[list[str]] = [[] for _ in range(n)]
    calls: list[list[ToolCallDelta]] = [[] for _ in range(n)]
    parts: list[list[dict[str, Any] | None]] = [[] for _ in range(n)]
    finish = ["stop"] * n
    last = [Piece("", None, 0)] * n
    logprobs: list[list[float]] = [[] for _ in range(n)]  # each choice's, for `keep`
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            i = piece.index
            texts[i].append(piece.text)
            if not piece.is_plain:
                reasonings[i].append(piece.reasoning)
                calls[i] += piece.tool_calls
            if reply.asks_logprobs:
                parts[i].append(reply.logprobs_of(piece))
            if keep is not None and piece.output is not None:
                logprobs[i] += (lp.logprob for lp in piece.output.logprobs)
            last[i] = piece
            if piece.finish_reason is not None:
                finish[i] = piece.finish_reason
    order: Sequence[int] = range(n)
    if keep is not None:  # the mean over the tokens that have logprobs (a stop string cuts some)
        order = sorted(order, key=lambda i: -sum(logprobs[i]) / max(len(logprobs[i]), 1))[:keep]
    choices = [
        ("".join(texts[i]), finish[i], reply.joined_logprobs(parts[i]),
         "".join(reasonings[i]) if reply.reasoning else None, ToolCallDelta.join(calls[i]))
        for i in order
    ]  # fmt: skip
    usage = reply.usage(last[0], sum(p.num_tokens for p in last[1:]))
    return reply.whole(choices, usage)


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + compact_json(body).encode() + b"\n\n"


_Shape = Literal["role", "text", "finish", "usage"]
# What a template's holes stand for: the response id, its `created`, the chunk's one value.
# Private-use text no real value holds.
_HOLES = ("\ue000kvrail-id\ue001", "\ue000kvrail-created\ue001", "\ue000kvrail-value\ue001")
_HOLE_AT = re.compile("|".join(re.escape(json.dumps(h)) for h in _HOLES))


@functools.lru_cache(maxsize=64)
def _template(
    kind: Kind, served_name: str, include_usage: bool, shape: _Shape
) -> tuple[bytes, bytes, bytes, bytes]:
    """A chunk of `shape` as `_event` writes it, cut at its holes, which come in `_HOLES`' order
    (the id and `created` lead every chunk): what comes before the id, before `created`,
    before the value and after it (a role chunk has no value: the last part is empty)."""
    rid, created, value = _HOLES
    reply = Reply(kind, rid, served_name, cast(int, created), 0, include_usage)
    if shape == "role":
        body = reply.chunk("", None, first=True)
    elif shape == "text":
        body = reply.chunk(value, None)
    elif shape == "finish":
        body = reply.chunk(None, value)
    else:
        body = reply.chunk(None, None, usage={})
        body["usage"] = value
    text = _event(body).decode()
    holes = [json.loads(hole) for hole in _HOLE_AT.findall(text)]
    if holes != list(_HOLES[: 2 if shape == "role" else 3]):  # a name equal to a hole
        raise ValueError(f"cannot make a chunk template for the model name {served_name!r}")
    parts = [part.encode() for part in _HOLE_AT.split(text)]
    before_id, before_created, before_value, *rest = parts
    return before_id, before_created, before_value, rest[0] if rest else b""


async def sse(
    reply: Reply, pieces: AsyncGenerator[Piece, None], count: Callable[[str], None]
) -> AsyncIterator[bytes]:
    """The response's events, one chunk of bytes per piece; the last piece's events, the usage
    chunk and `[DONE]` leave together, as the body's `Last` bytes (a choice that finishes before
    the others sends its finish chunk at once). `count` gets the response's HTTP status once it
    ends (499: the client left)."""
    status = "499"  # the client left before the end
    last = [Piece("", None, 0)] * reply.num_choices
    every = reply.continuous_usage_stats
    asked = reply.asks_logprobs
    unfinished = reply.num_choices
    tail = b""  # the last finished piece's events, sent with the end
    try:
        if reply.kind == "chat":
            for i in range(reply.num_choices):
                yield (
                    _event(reply.chunk("", None, _usage(reply, last, 0), first=True, index=i))
                    if every
                    else reply.role_event(i)
                )
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                index = piece.index
                last[index] = piece
                usage = _usage(reply, last, index) if every else None
                events = b""
                if not piece.is_plain:
                    events = reply.parsed_events(piece, usage)
                elif asked:
                    events = reply.logprobs_event(piece, usage)
                elif piece.text and usage is None:
                    events = reply.text_event(piece.text, index)
                elif piece.text:
                    events = _event(reply.chunk(piece.text, None, usage, index=index))
                if piece.finish_reason is None:
                    if events:
                        yield events
                    continue
                events += (
                    reply.finish_event(piece.finish_reason, index)
                    if usage is None
                    else _event(reply.chunk(None, piece.finish_reason, usage, index=index))
                )
                unfinished -= 1
                if unfinished:
                    yield events
                else:
                    tail = events
        if reply.include_usage:
            tail += reply.usage_event(_usage(reply, last, 0))
        status = "200"
    except ApiError as err:
        status = str(err.status)
        tail += _event(err.body())
    finally:
        count(status)
    yield Last(tail + b"data: [DONE]\n\n")


def _usage(reply: Reply, last: Sequence[Piece], index: int) -> dict[str, Any]:
    """Usage as of each choice's latest piece (`last`), `index`'s the one just in."""
    others = sum(p.num_tokens for i, p in enumerate(last) if i != index)
    return reply.usage(last[index], others)
