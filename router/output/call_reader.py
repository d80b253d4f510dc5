"""One tool call's JSON object read as the model writes it: `{"name": "f", "arguments": {...}}`
(`CallReader`), with where a JSON value ends in text that arrives in pieces (`ValueEnd`).

Pure Python over text; the tool-call parsers (`kvrail.router.output.tool_calls`) frame the
objects (Hermes tags, Llama's bare JSON, Mistral's array) and hand each object's text here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

_WHITESPACE = " \t\r\n"
_DELIMITERS = _WHITESPACE + ",]}"
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes and Mistral say arguments, Llama parameters


class ValueEnd:
    """Where one JSON value ends, in text fed in pieces: a string at its closing quote, an
    object or array at its matching bracket, a number or literal before the delimiter after it.
    It does not check that the value is valid JSON, only where it ends."""

    __slots__ = ("_depth", "_escape", "_in_string", "_kind", "done")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._kind = ""  # "", "string", "container" or "scalar"
        self.done = False

    def scan(self, text: str, start: int) -> int | None:
        """Read `text` from `start` (the value's first character, or where the last call stopped);
        return the index just past the value's end, or None if it goes on past `text`."""
        i = start
        n = len(text)
        while i < n:
            c = text[i]
            if not self._kind:
                self._kind = "string" if c == '"' else "container" if c in "{[" else "scalar"
                if self._kind == "string":
                    self._in_string = True
                    i += 1
                    continue
                if self._kind == "scalar":
                    continue
            if self._kind == "scalar":
                if c in _DELIMITERS:
                    self.done = True
                    return i
                i += 1
                continue
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._kind == "string":
                        self.done = True
                        return i + 1
                i += 1
                continue
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.done = True
                    return i + 1
            i += 1
        return None

    def end_of_text(self) -> bool:
        """At the end of the output: whether a number or literal ended with it (it had no
        delimiter after it)."""
        if self._kind == "scalar":
            self.done = True
        return self.done


_State = Literal["open", "key", "colon", "value_at", "value", "comma", "done", "bad"]


@dataclass(slots=True)
class CallReader:
    """Reads one call's object as it arrives (`feed`), so that its function name and the first
    characters of its arguments can be streamed before the object is complete.

    Arguments are streamed as the model writes them (`arguments` grows) once the name is known
    and the arguments are an object; otherwise (arguments before the name, or given as a JSON
    string) they come whole when the object ends. `done` turns True at the object's closing
    brace, `bad` when the text is not such an object (the parser then hands it back as text).
    """

    text: str = ""
    """The object's text so far."""
    name: str | None = None
    arguments: str = ""
    """The arguments' JSON text so far, while `streaming`."""
    streaming: bool = False
    """The arguments are being streamed (`arguments` grows as they arrive)."""
    _state: _State = "open"
    _pos: int = 0
    _key: str | None = None
    """The key whose value is being read; None while a key itself is read."""
    _value_start: int = 0
    _scan_at: int = 0
    _scanner: ValueEnd = field(default_factory=ValueEnd)
    _given_arguments: str | None = None

    @property
    def done(self) -> bool:
        return self._state == "done"

    @property
    def bad(self) -> bool:
        return self._state == "bad"

    def feed(self, text: str) -> int:
        """Append `text`; return how many of its characters belong to the object (all of them
        until its closing brace; the rest is the caller's)."""
        if self._state in ("done", "bad"):
            return 0
        offset = len(self.text)
        self.text += text
        self._advance()
        if self._state == "done":
            return self._pos - offset
        return len(text)

    def finish(self) -> None:
        """At the end of the output: a number or literal cut short ends here; a call that never
        named its function is bad (one whose name was sent keeps what its arguments had)."""
        if self._state == "value" and self._scanner.end_of_text():
            self._take_value(len(self.text))
        if self._state != "done" and self.name is None:
            self._state = "bad"

    @property
    def whole_arguments(self) -> str:
        """The call's arguments: as streamed, or the value given whole (a JSON string decoded),
        `{}` when there were none."""
        if self.streaming:
            return self.arguments
        return self._given_arguments if self._given_arguments is not None else "{}"

    def _advance(self) -> None:
        text = self.text
        while self._state not in ("done", "bad"):
            if self._state == "value":
                end = self._scanner.scan(text, self._scan_at)
                if self.streaming:
                    self.arguments = text[self._value_start : len(text) if end is None else end]
                if end is None:
                    self._scan_at = len(text)
                    return
                self._take_value(end)
                continue
            i = self._pos
            while i < len(text) and text[i] in _WHITESPACE:
                i += 1
            self._pos = i
            if i == len(text):
                return
            self._step(text[i], i)

    def _step(self, c: str, i: int) -> None:
        """One structural character `c` at `i`, outside any value."""
        state = self._state
        if state == "open":
            self._state = "key" if c == "{" else "bad"
            self._pos = i + 1
        elif state == "key" and c == '"':
            self._key = None
            self._start_value(i)
        elif state in ("key", "comma") and c == "}":
            self._state = "done"
            self._pos = i + 1
        elif state == "comma" and c == ",":
            self._state = "key"
            self._pos = i + 1
        elif state == "colon" and c == ":":
            self._state = "value_at"
            self._pos = i + 1
        elif state == "value_at":
            self.streaming = self._key in ARGUMENT_KEYS and self.name is not None and c == "{"
            self._start_value(i)
        else:
            self._state = "bad"

    def _start_value(self, at: int) -> None:
        self._state = "value"
        self._value_start = self._scan_at = at
        self._scanner = ValueEnd()

    def _take_value(self, end: int) -> None:
        """The key or value from `_value_start` to `end` is complete."""
        raw = self.text[self._value_start : end]
        self._pos = end
        key = self._key
        if key is None:  # a key was read
            parsed = _loads(raw)
            self._key = parsed if isinstance(parsed, str) else None
            self._state = "colon" if self._key is not None else "bad"
            return
        self._state = "comma"
        if key == "name":
            name = _loads(raw)
            if not isinstance(name, str) or self.name is not None:
                self._state = "bad"
            else:
                self.name = name
        elif key in ARGUMENT_KEYS and not self.streaming:
            self._given_arguments = _arguments_text(raw)
            if self._given_arguments is None:
                self._state = "bad"


def _loads(raw: str) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _arguments_text(raw: str) -> str | None:
    """A call's arguments as OpenAI sends them (JSON text of an object): an object as written,
    a JSON string holding one decoded; None for anything else."""
    if raw.startswith("{"):
        return raw
    value = _loads(raw)
    return value if isinstance(value, str) else None
