"""The thinking of a reasoning model (Qwen3, DeepSeek-R1 and its distills) split from its
answer as the text streams (`ReasoningSplitter`, one per choice).

Such a model thinks between `<think>` and `</think>` before it answers. Either the chat template
opens the thinking itself (its generation prompt ends inside `<think>`, as DeepSeek-R1's does:
`opened=True`), and everything up to `</think>` is reasoning; or the model may open it: an
answer whose first non-blank text is `<think>` thinks until `</think>`, any other answer is all
content (a model told not to think). The tags are never part of either text; the blank lines
between `</think>` and the answer are dropped. An answer cut off while thinking is all
reasoning. Tails that may begin a tag are held back, so the same text gives the same split
whatever pieces it arrives in.
"""

from __future__ import annotations

from typing import Literal

from kvrail.router.output.tool_calls import held

START, END = "<think>", "</think>"
_WHITESPACE = " \t\r\n"


class ReasoningSplitter:
    def __init__(self, opened: bool) -> None:
        self._state: Literal["start", "thinking", "after", "answer"] = (
            "thinking" if opened else "start"
        )
        self._buffer = ""

    @property
    def thinking(self) -> bool:
        """Whether the text so far ends inside the thinking (or may still open it)."""
        return self._state in ("start", "thinking")

    def feed(self, text: str) -> tuple[str, str]:
        """More of the model's text: (reasoning, content) it completes."""
        self._buffer += text
        return self._split(final=False)

    def flush(self) -> tuple[str, str]:
        """At the end of the output: whatever was held back."""
        return self._split(final=True)

    def _split(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        while True:
            buffer = self._buffer
            if self._state == "answer":
                self._buffer = ""
                return reasoning, buffer
            if self._state == "start":
                rest = buffer.lstrip(_WHITESPACE)
                if rest.startswith(START):
                    self._buffer, self._state = rest[len(START) :], "thinking"
                elif START.startswith(rest) and not final:
                    return reasoning, ""
                else:
                    self._state = "answer"
            elif self._state == "thinking":
                at = buffer.find(END)
                if at < 0:
                    keep = 0 if final else held(buffer, END)
                    self._buffer = buffer[len(buffer) - keep :]
                    return reasoning + buffer[: len(buffer) - keep], ""
                reasoning += buffer[:at]
                self._buffer, self._state = buffer[at + len(END) :], "after"
            else:  # after the thinking: the blank lines before the answer
                rest = buffer.lstrip(_WHITESPACE)
                self._buffer = rest
                if not rest:
                    return reasoning, ""
                self._state = "answer"
