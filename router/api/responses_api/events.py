"""A Response from the pieces of the chat completion that serves it: one body, or its
server-sent events (`ResponseRender`, which `generate.serve` calls instead of the chat
rendering).

`Output` is the pure core: it takes the pieces' deltas in order and keeps the output items
they make, returning the events that tell each change, as OpenAI streams them:
`response.output_item.added` when an item opens (a reasoning item, the message, a function
call); for the message `response.content_part.added`, a `response.output_text.delta` per piece
with text, then `response.output_text.done` and `response.content_part.done`; for reasoning the
same with `reasoning_text`; for a function call `response.function_call_arguments.delta` /
`.done`; `response.output_item.done` when an item closes (the next one opens, or the answer
ends). Streamed or not, the same `Output` builds the items, so the two agree.

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
from kvrail.router.api.responses_api.body import ItemStatus, Status
from kvrail.router.api.streaming import Piece, Reply

Event = dict[str, Any]


class Output:
    """The output items of one response (`items`), built from its deltas in order."""

    def __init__(self, response_id: str) -> None:
        self._suffix = response_id.partition("_")[2] or response_id
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item still growing
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []

    def text(self, delta: str, logprobs: Sequence[dict[str, Any]] = ()) -> list[Event]:
        """Answer text (and its tokens' logprobs, when asked)."""
        if not delta and not logprobs:
            return []
        events = self._open_item("message") if self._kind != "message" else []
        self._text.append(delta)
        self._logprobs += logprobs
        events.append(self._part_event("response.output_text.delta", delta=delta,
                                       logprobs=list(logprobs)))  # fmt: skip
        return events

    def finish(self, status: ItemStatus) -> list[Event]:
        """The end of the answer: the open item closes with `status` (a response with no item
        gets its message, empty)."""
        events = [] if self.items else self._open_item("message")
        return events + self._close(status)

    @property
    def _kind(self) -> str | None:
        return None if self._open is None else str(self._open["type"])

    def _open_item(self, kind: str) -> list[Event]:
        events = self._close("completed")
        index = len(self.items)
        if kind == "message":
            item = body.message_item(f"msg_{self._suffix}", "in_progress")
        else:
            raise ValueError(f"unknown output item kind {kind!r}")
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": dict(item, content=[])})  # fmt: skip
        events.append(self._part_event("response.content_part.added", part=body.output_text("")))
        return events

    def _close(self, status: ItemStatus) -> list[Event]:
        item = self._open
        if item is None:
            return []
        text = "".join(self._text)
        part = body.output_text(text, self._logprobs)
        events = [
            self._part_event("response.output_text.done", text=text, logprobs=part["logprobs"]),
            self._part_event("response.content_part.done", part=part),
        ]
        item["content"] = [part]
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": item})  # fmt: skip
        self._open, self._text, self._logprobs = None, [], []
        return events

    def _part_event(self, kind: str, **fields: Any) -> Event:
        assert self._open is not None
        return {
            "type": kind, "item_id": self._open["id"], "output_index": len(self.items) - 1,
            "content_index": 0, **fields,
        }  # fmt: skip


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
                    output.text(piece.text, _logprobs(reply, piece))
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
                    events = output.text(piece.text, _logprobs(reply, piece))
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
            error = {"code": err.code or _error_code(err.status), "message": err.message}
            failed = self._response(reply, "failed", output.items, _usage(reply, last), error)
            tail = write([{"type": "response.failed", "response": failed}])
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


def _logprobs(reply: Reply, piece: Piece) -> list[dict[str, Any]]:
    """The piece's tokens' logprobs as an `output_text` part lists them (when asked)."""
    if not reply.asks_logprobs:
        return []
    logprobs = reply.logprobs_of(piece)
    return list(logprobs["content"] or ()) if logprobs else []


def _usage(reply: Reply, last: Piece) -> dict[str, Any]:
    return body.usage(reply.num_prompt_tokens, last.num_tokens, last.num_cached_tokens)


def _error_code(status: int) -> str:
    """OpenAI's `response.error.code` for an error that has no code of its own."""
    return "rate_limit_exceeded" if status == 429 else "server_error"
