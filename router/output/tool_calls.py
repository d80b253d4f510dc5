"""Tool calls parsed out of a model's text as it streams, one parser per choice, per model family:

- `hermes` (Qwen2.5, Qwen3, Hermes, and kvrail's default tool prompt): `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`, repeated for several calls; text before a call is content;
- `llama3_json` (Llama 3.1+ JSON tool calling): an answer that starts with `{` (or Llama's
  `<|python_tag|>`) is a call `{"name": ..., "parameters": {...}}`, several separated by `;`;
  any other answer is content;
- `mistral`: `[TOOL_CALLS]` followed by a JSON array of `{"name": ..., "arguments": {...}}`.

Each parser turns text into (content, `ToolCallDelta`s): a call's first delta (its id and name)
leaves as soon as its name is read, and its arguments as the model writes them; a tail that may
be the start of a marker is held back, so no markup ever reaches the content. What is not a
call after all (a marker followed by something other than a call object) is content, markup
included; a call the end of the output cuts off before its name is dropped (its markup never
reaches the content), one cut off after it keeps the arguments it had (the finish reason says
`length`). `parallel=False` keeps only the first call (the text of later ones is dropped, as
vLLM does). The same text gives the same result whatever pieces it arrives in, which is how a
whole response equals its stream.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Literal

from kvrail.router.output.call_reader import CallReader
from kvrail.router.output.piece import ToolCallDelta

ParserName = Literal["hermes", "llama3_json", "mistral"]
PARSERS: tuple[ParserName, ...] = ("hermes", "llama3_json", "mistral")
_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    """A tool call's id as OpenAI writes them: `call_` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


def held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (to hold back)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallParser:
    """The shared half of a parser: the call being read and the deltas it makes. Subclasses
    frame the calls (`_feed` returns the content found)."""

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        self.parallel = parallel
        self.num_calls = 0
        """Calls announced so far (those kept: with `parallel=False`, at most one)."""
        self._new_id = new_id
        self._buffer = ""
        self._call: CallReader | None = None
        self._announced = False
        self._sent = 0  # characters of the current call's arguments sent
        self._deltas: list[ToolCallDelta] = []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """More text of the answer: the content and call deltas it completes."""
        self._buffer += text
        content = self._feed(final=False)
        deltas, self._deltas = self._deltas, []
        return content, deltas

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the answer: whatever was held back."""
        content = self._feed(final=True)
        deltas, self._deltas = self._deltas, []
        return content, deltas

    def _feed(self, final: bool) -> str:
        raise NotImplementedError

    # -- the call being read --------------------------------------------------------------

    def _start_call(self) -> None:
        self._call = CallReader()
        self._announced = False
        self._sent = 0

    def _read_call(self, final: bool) -> str | None:
        """Feed the buffer to the call being read. Returns None while the call goes on (the
        buffer is consumed), "" once it ended (the buffer holds what follows it), or the text
        to give back as content when it turned out not to be a call."""
        call = self._call
        assert call is not None
        used = call.feed(self._buffer)
        self._buffer = self._buffer[used:]
        cut_short = final and not call.done and not call.bad
        if final and not call.done:
            call.finish()
        self._emit(call)
        if call.bad and not self._announced:
            self._call = None
            return "" if cut_short else call.text
        if call.done or call.bad or final:
            self._call = None
            return ""
        return None

    def _emit(self, call: CallReader) -> None:
        keep = self.parallel or self.num_calls == 0 or self._announced
        if not keep:
            return
        if not self._announced and call.name is not None and (call.streaming or call.done):
            self._announced = True
            self.num_calls += 1
            self._deltas.append(ToolCallDelta(self.num_calls - 1, self._new_id(), call.name))
        if not self._announced:
            return
        if call.streaming:
            fresh = call.arguments[self._sent :]
        elif call.done:
            fresh = call.whole_arguments[self._sent :]
        else:
            fresh = ""
        if fresh:
            self._sent += len(fresh)
            self._deltas.append(ToolCallDelta(self.num_calls - 1, arguments=fresh))

    def _skip_whitespace(self) -> bool:
        """Drop the buffer's leading whitespace; whether anything is left."""
        self._buffer = self._buffer.lstrip(_WHITESPACE)
        return bool(self._buffer)


class HermesParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(parallel, new_id)
        self._state: Literal["text", "call", "close"] = "text"
        self._after_call = False  # whitespace between and after calls is not content

    def _feed(self, final: bool) -> str:
        out: list[str] = []
        while True:
            if self._state == "text":
                at = self._buffer.find(self.OPEN)
                cut = (
                    at
                    if at >= 0
                    else len(self._buffer) - (0 if final else held(self._buffer, self.OPEN))
                )
                text, self._buffer = self._buffer[:cut], self._buffer[cut:]
                if self._after_call:
                    text = text.lstrip(_WHITESPACE)
                    self._after_call = not text
                out.append(text)
                if at < 0:
                    return "".join(out)
                self._buffer = self._buffer[len(self.OPEN) :]
                self._start_call()
                self._state = "call"
            elif self._state == "call":
                given_back = self._read_call(final)
                if given_back is None:
                    return "".join(out)
                if given_back:
                    out.append(self.OPEN + given_back)
                    self._state = "text"
                else:
                    self._state = "close"
            else:  # after a call: its closing tag, if it comes
                if not self._skip_whitespace():
                    self._after_call = True
                    return "".join(out)
                if self._buffer.startswith(self.CLOSE):
                    self._buffer = self._buffer[len(self.CLOSE) :]
                elif self.CLOSE.startswith(self._buffer) and not final:
                    return "".join(out)
                self._state, self._after_call = "text", True


class Llama3JsonParser(ToolCallParser):
    TAG = "<|python_tag|>"

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(parallel, new_id)
        self._state: Literal["start", "text", "call", "between"] = "start"

    def _feed(self, final: bool) -> str:
        out: list[str] = []
        while True:
            if self._state == "text":
                out.append(self._buffer)
                self._buffer = ""
                return "".join(out)
            if self._state == "start":
                rest = self._buffer.lstrip(_WHITESPACE)
                if rest.startswith(self.TAG) or rest.startswith("{"):
                    self._buffer = rest.removeprefix(self.TAG)
                    self._start_call()
                    self._state = "call"
                elif (not rest or self.TAG.startswith(rest)) and not final:
                    return "".join(out)
                else:
                    self._state = "text"
            elif self._state == "call":
                given_back = self._read_call(final)
                if given_back is None:
                    return "".join(out)
                if given_back:
                    out.append(given_back)
                self._state = "text" if given_back else "between"
            else:  # between calls: `;` and the next, or the end
                if not self._skip_whitespace():
                    return "".join(out)
                if self._buffer[0] in ";{":
                    self._buffer = self._buffer.removeprefix(";")
                    self._start_call()
                    self._state = "call"
                else:
                    self._state = "text"


class MistralParser(ToolCallParser):
    MARKER = "[TOOL_CALLS]"

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(parallel, new_id)
        self._state: Literal["text", "open", "call", "between"] = "text"

    def _feed(self, final: bool) -> str:
        out: list[str] = []
        while True:
            if self._state == "text":
                at = self._buffer.find(self.MARKER)
                cut = (
                    at
                    if at >= 0
                    else len(self._buffer) - (0 if final else held(self._buffer, self.MARKER))
                )
                out.append(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                if at < 0:
                    return "".join(out)
                self._buffer = self._buffer[len(self.MARKER) :]
                self._state = "open"
            elif self._state == "open":  # the array's bracket (or a lone object)
                if not self._skip_whitespace():
                    return "".join(out)
                if self._buffer[0] not in "[{":
                    out.append(self.MARKER)
                    self._state = "text"
                    continue
                self._buffer = self._buffer.removeprefix("[")
                self._start_call()
                self._state = "call"
            elif self._state == "call":
                given_back = self._read_call(final)
                if given_back is None:
                    return "".join(out)
                if given_back:
                    out.append(self.MARKER + given_back)
                self._state = "text" if given_back else "between"
            else:
                if not self._skip_whitespace():
                    return "".join(out)
                if self._buffer[0] == ",":
                    self._buffer = self._buffer[1:].lstrip(_WHITESPACE)
                    self._start_call()
                    self._state = "call"
                else:
                    self._buffer = self._buffer.removeprefix("]")
                    self._state = "text"


def tool_call_parser(
    name: ParserName, parallel: bool = True, new_id: Callable[[], str] = new_call_id
) -> ToolCallParser:
    """A fresh parser of family `name` for one choice."""
    kind = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
    return kind[name](parallel, new_id)
