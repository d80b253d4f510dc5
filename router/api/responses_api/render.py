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
    finish reason."""
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
        output = Output(reply.response_id)
        last, finish = Piece("", None, 0), None
        try:
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    _feed(output, reply, piece)
                    last, finish = piece, piece.finish_reason or finish
        except ApiError as err:
            raise self._rename(err) from None
        status, incomplete = _status(finish)
        output.finish("incomplete" if incomplete else "completed")
        return self._response(reply, status, output.items, _usage(reply, last), None, incomplete)

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
        output = Output(reply.response_id)
        last, finish = Piece("", None, 0), None
        opening = self._response(reply, "in_progress", [], None)
        tail = b""
        try:
            yield write([{"type": "response.created", "response": opening},
                         {"type": "response.in_progress", "response": opening}])  # fmt: skip
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    events = _feed(output, reply, piece)
                    last, finish = piece, piece.finish_reason or finish
                    if events:
                        yield write(events)
            status, incomplete = _status(finish)
            events = output.finish("incomplete" if incomplete else "completed")
            whole = self._response(
                reply, status, output.items, _usage(reply, last), None, incomplete
            )
            events.append({"type": f"response.{status}", "response": whole})
            tail = write(events)
            status_code = "200"
        except ApiError as err:
            err = self._rename(err)
            status_code = str(err.status)
            error = body.response_error(err.status, err.message, err.type, err.param)
            events = output.fail()  # what came so far, before the response that holds it
            failed = self._response(reply, "failed", output.items, _usage(reply, last), error)
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


def _feed(output: Output, reply: Reply, piece: Piece) -> list[Event]:
    """The piece's deltas into `output`: the events they make."""
    logprobs: list[dict[str, Any]] = []
    if reply.asks_logprobs:  # the piece's tokens', with its text (OpenAI has them nowhere else)
        entries = reply.logprobs_of(piece)
        logprobs = list(entries["content"] or ()) if entries else []
    return output.text(piece.text, logprobs)


def _usage(reply: Reply, last: Piece) -> dict[str, Any]:
    return body.usage(reply.num_prompt_tokens, last.num_tokens, last.num_cached_tokens)
