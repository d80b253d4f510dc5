"""A Response from the pieces of the chat completion that serves it: one body, or its
server-sent events (`ResponseRender`, which `generate.serve` calls instead of the chat
rendering). Streamed or not, the same `output.Output` builds the items from the pieces, so the
two agree.

The stream opens with `response.created` and `response.in_progress` (the response with no
output yet) and ends with `response.completed`, or `response.incomplete` when the answer was
cut at `max_output_tokens` (the items then have status `incomplete`), or `response.failed`
(with the error) when the request fails midway; every event has its `sequence_number`, from 0.
No `[DONE]` follows, as in OpenAI's API.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from kvrail.codec import compact_json
from kvrail.router.api import streaming
from kvrail.router.api.errors import ApiError
from kvrail.router.api.responses_api import body
from kvrail.router.api.responses_api.body import Status
from kvrail.router.api.responses_api.output import Event, Output
from kvrail.router.api.streaming import Piece, Reply


def _status(finish_reason: str | None) -> tuple[Status, str | None]:
    """A response's status, and why it is incomplete (None when it is not), from its chat
    finish reason (`stop`, `tool_calls`: completed; `length`: cut at the token limit)."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


class ResponseRender:
    """Renders the pieces of the chat completion serving a Responses request as a Response
    (`collect`) or its events (`sse`); `fields` are the request's `body.restated` ones,
    `rename` names a chat field as the Responses field it came from."""

    def __init__(
        self, fields: Mapping[str, Any], rename: Callable[[ApiError], ApiError] = lambda e: e
    ) -> None:
        self.fields = fields
        self._rename = rename

    async def collect(self, pieces: AsyncGenerator[Piece, None], reply: Reply) -> dict[str, Any]:
        """The whole Response. Raises ApiError (named as the Responses field)."""
        answer = _Answer(reply)
        try:
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    answer.feed(piece)
        except ApiError as err:
            raise self._rename(err) from None
        status, incomplete = _status(answer.finish_reason)
        answer.output.finish("incomplete" if incomplete else "completed")
        items = answer.output.items
        return self._response(reply, status, items, answer.usage(), None, incomplete)

    async def sse(
        self, reply: Reply, pieces: AsyncGenerator[Piece, None], count: Callable[[str], None]
    ) -> AsyncIterator[bytes]:
        """The response's events, a chunk of bytes per piece; the last events leave together
        (`streaming.Last`). `count` gets the HTTP status once it ends (499: the client
        left)."""
        sequence = 0

        def write(events: Sequence[Event]) -> bytes:
            nonlocal sequence
            out = []
            for event in events:
                event = {"type": event["type"], "sequence_number": sequence, **event}
                sequence += 1
                out.append(f"event: {event['type']}\ndata: {compact_json(event)}\n\n")
            return "".join(out).encode()

        status_code = "499"  # the client left before the end
        answer = _Answer(reply)
        output = answer.output
        opening = self._response(reply, "in_progress", [], None)
        tail = b""
        try:
            yield write([{"type": "response.created", "response": opening},
                         {"type": "response.in_progress", "response": opening}])  # fmt: skip
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    events = answer.feed(piece)
                    if events:
                        yield write(events)
            status, incomplete = _status(answer.finish_reason)
            events = output.finish("incomplete" if incomplete else "completed")
            whole = self._response(reply, status, output.items, answer.usage(), None, incomplete)
            events.append({"type": f"response.{status}", "response": whole})
            tail = write(events)
            status_code = "200"
        except ApiError as err:
            err = self._rename(err)
            status_code = str(err.status)
            error = body.response_error(err.status, err.message, err.type, err.param)
            events = output.fail()  # what came so far, before the response that holds it
            failed = self._response(reply, "failed", output.items, answer.usage(), error)
            tail = write([*events, {"type": "response.failed", "response": failed}])
        finally:
            count(status_code)
        yield streaming.Last(tail)

    def _response(
        self,
        reply: Reply,
        status: Status,
        items: Sequence[dict[str, Any]],
        usage: dict[str, Any] | None,
        error: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        return body.response_object(
            reply.response_id, reply.created, reply.served_name, self.fields, status, items,
            usage, error, incomplete,
        )  # fmt: skip


class _Answer:
    """One answer's pieces into its `Output` (`feed`), counting its reasoning's tokens: those of
    the pieces that held only reasoning (a piece where the thinking ends and the answer begins
    counts for the answer)."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.output = Output(reply.response_id)
        self.last = Piece("", None, 0)
        self.finish_reason: str | None = None
        self.num_reasoning_tokens = 0

    def feed(self, piece: Piece) -> list[Event]:
        """The piece's deltas into the output, in the model's order: the events they make."""
        if piece.reasoning and not piece.text and not piece.tool_calls:
            self.num_reasoning_tokens += piece.num_tokens - self.last.num_tokens
        self.last, self.finish_reason = piece, piece.finish_reason or self.finish_reason
        output = self.output
        logprobs: list[dict[str, Any]] = []
        if self.reply.asks_logprobs and piece.text:  # OpenAI has them with the text only
            entries = self.reply.logprobs_of(piece)
            logprobs = list(entries["content"] or ()) if entries else []
        events = output.reasoning(piece.reasoning) + output.text(piece.text, logprobs)
        for call in piece.tool_calls:
            events += output.tool_call(call.index, call.id, call.name, call.arguments)
        return events

    def usage(self) -> dict[str, Any]:
        last = self.last
        return body.usage(
            self.reply.num_prompt_tokens, last.num_tokens, last.num_cached_tokens,
            self.num_reasoning_tokens,
        )  # fmt: skip
