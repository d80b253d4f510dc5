"""A Response's output items as its answer's pieces build them (`Output`), and the events that
tell each change, as OpenAI's API streams them.

Pure: deltas in (reasoning, answer text with its tokens' logprobs, tool-call fragments), in the
order the model wrote them; items and events out. An item opens when a delta of another kind
than the open one's comes (the open one closes first), so the items are in the model's order:

- reasoning: `response.output_item.added` (a `reasoning` item), `response.content_part.added`
  (a `reasoning_text` part), a `response.reasoning_text.delta` per delta, then
  `response.reasoning_text.done`, `response.content_part.done`, `response.output_item.done`;
- answer text: the same with a `message` item, its `output_text` part and
  `response.output_text.delta` / `.done` (each with its tokens' `logprobs`, `[]` when not
  asked);
- a tool call: `response.output_item.added` (a `function_call` item with its `call_id` and
  `name`), a `response.function_call_arguments.delta` per fragment of its arguments, then
  `response.function_call_arguments.done` and `response.output_item.done`; each call is its
  own item.

`finish` closes the open item with the answer's status (`incomplete` when it was cut short);
an answer with no item at all gets an empty message, so that a Response always says something.
`fail` closes it `incomplete` when the request failed midway.
Events carry no `sequence_number`: the stream numbers them as it writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from kvrail.router.api.responses_api import body
from kvrail.router.api.responses_api.body import ItemStatus

Event = dict[str, Any]
Kind = Literal["message", "reasoning", "function_call"]
_ID_PREFIX: dict[Kind, str] = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


class Output:
    """The output items of one response (`items`), built from its deltas in order; item ids are
    made from `response_id`'s random part and the item's place."""

    def __init__(self, response_id: str) -> None:
        self._suffix = response_id.partition("_")[2] or response_id
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item still growing
        self._call_index: int | None = None  # the open function call's index in the answer
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []

    def reasoning(self, delta: str) -> list[Event]:
        """Thinking text."""
        if not delta:
            return []
        events = self._open_item("reasoning") if self._kind != "reasoning" else []
        self._text.append(delta)
        events.append(self._part_event("response.reasoning_text.delta", delta=delta))
        return events

    def text(self, delta: str, logprobs: Sequence[dict[str, Any]] = ()) -> list[Event]:
        """Answer text, and its tokens' logprobs (when asked)."""
        if not delta and not logprobs:
            return []
        events = self._open_item("message") if self._kind != "message" else []
        self._text.append(delta)
        self._logprobs += logprobs
        events.append(self._part_event("response.output_text.delta", delta=delta,
                                       logprobs=list(logprobs)))  # fmt: skip
        return events

    def tool_call(
        self, index: int, call_id: str | None, name: str | None, arguments: str
    ) -> list[Event]:
        """A fragment of the answer's tool call `index` (its first has the call's id and
        name)."""
        events: list[Event] = []
        if self._kind != "function_call" or self._call_index != index:
            call = call_id or f"call_{self._suffix}_{index}"
            events = self._open_item("function_call", call_id=call, name=name or "")
            self._call_index = index
        if arguments:
            self._text.append(arguments)
            events.append(self._event("response.function_call_arguments.delta", delta=arguments))
        return events

    def finish(self, status: ItemStatus) -> list[Event]:
        """The end of the answer: the open item closes with `status` (an answer with no item
        gets its message, empty)."""
        events = [] if self.items else self._open_item("message")
        return events + self._close(status)

    def fail(self) -> list[Event]:
        """The answer failed midway: the open item closes, `incomplete`, with what it had."""
        return self._close("incomplete")

    @property
    def _kind(self) -> Kind | None:
        return None if self._open is None else self._open["type"]

    def _open_item(self, kind: Kind, call_id: str = "", name: str = "") -> list[Event]:
        events = self._close("completed")
        item_id = f"{_ID_PREFIX[kind]}_{self._suffix}_{len(self.items)}"
        if kind == "message":
            item = body.message_item(item_id, "in_progress")
            part: dict[str, Any] | None = body.output_text("")
        elif kind == "reasoning":
            item, part = body.reasoning_item(item_id, "in_progress"), body.reasoning_text("")
        else:
            item, part = body.function_call_item(item_id, "in_progress", call_id, name, ""), None
        self.items.append(item)
        self._open = item
        events.append(self._event("response.output_item.added", item=dict(item)))
        if part is not None:
            events.append(self._part_event("response.content_part.added", part=part))
        return events

    def _close(self, status: ItemStatus) -> list[Event]:
        item, kind = self._open, self._kind
        if item is None:
            return []
        text = "".join(self._text)
        events: list[Event] = []
        if kind == "function_call":
            item["arguments"] = text
            events.append(self._event("response.function_call_arguments.done", arguments=text))
        else:
            if kind == "message":
                part = body.output_text(text, self._logprobs)
                events.append(self._part_event("response.output_text.done", text=text,
                                               logprobs=part["logprobs"]))  # fmt: skip
            else:
                part = body.reasoning_text(text)
                events.append(self._part_event("response.reasoning_text.done", text=text))
            events.append(self._part_event("response.content_part.done", part=part))
            item["content"] = [part]
        item["status"] = status
        events.append(self._event("response.output_item.done", item=item))
        self._open, self._call_index, self._text, self._logprobs = None, None, [], []
        return events

    def _event(self, kind: str, **fields: Any) -> Event:
        """An event about the open item (the last one)."""
        assert self._open is not None
        where: dict[str, Any] = {"output_index": len(self.items) - 1}
        if "item" not in fields:
            where["item_id"] = self._open["id"]
        return {"type": kind, **where, **fields}

    def _part_event(self, kind: str, **fields: Any) -> Event:
        """An event about the open item's one content part."""
        return self._event(kind, content_index=0, **fields)
