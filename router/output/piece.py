"""What a response is made of, piece by piece (`Piece`), and what a piece says of a tool call
(`ToolCallDelta`).

`kvrail.router.generate` yields the pieces of each choice; the renderers (`kvrail.router.api.
streaming`, and any other endpoint's) turn each piece into chunks or fold all of them into one
body. A piece is self-describing: its `text` is the answer's text (OpenAI's `content`), its
`reasoning` the model's thinking, its `tool_calls` fragments of the calls it makes, each field
only what is new since the choice's previous piece, so that concatenating a choice's pieces
gives its whole output (`ToolCallDelta.join` for the calls). A request that asks for no parsing
(no tools, no reasoning parser) gets pieces with text only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvrail.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of tool call `index` (the choice's calls are numbered from 0 in order).

    A call's first fragment has its `id` (`call_...`) and function `name`; every fragment may
    carry more of its `arguments`, the JSON text of the function's arguments as the model wrote
    it; a call's fragments joined in order give the whole of it. OpenAI's streamed
    `delta.tool_calls[i]`, fragment for fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    @staticmethod
    def join(deltas: Iterable[ToolCallDelta]) -> list[ToolCallDelta]:
        """The whole calls of a choice's fragments, in order of their index (each with its id,
        name and all of its arguments)."""
        calls: dict[int, ToolCallDelta] = {}
        for d in deltas:
            known = calls.get(d.index)
            if known is None:
                calls[d.index] = d
            else:
                calls[d.index] = ToolCallDelta(
                    d.index, known.id or d.id, known.name or d.name, known.arguments + d.arguments
                )
        return [calls[i] for i in sorted(calls)]

    @staticmethod
    def merged(deltas: Sequence[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
        """`deltas` with consecutive fragments of one call made one (fewer, larger chunks)."""
        out: list[ToolCallDelta] = []
        for d in deltas:
            if out and out[-1].index == d.index and (d.id is None or out[-1].id is None):
                last = out[-1]
                d = ToolCallDelta(
                    d.index, last.id or d.id, last.name or d.name, last.arguments + d.arguments
                )
                out[-1] = d
            else:
                out.append(d)
        return tuple(out)


@dataclass(frozen=True, slots=True)
class Piece:
    """What one chunk of a response says.

    - `text`: answer text (detokenized, stop strings applied; with a parser, what is left once
      reasoning and tool-call markup are taken out);
    - `finish_reason` on a choice's last piece: `stop`, `length`, or `tool_calls` when the
      choice made tool calls and ended by itself;
    - `num_tokens`: the choice's output tokens so far; `num_cached_tokens`: its prompt tokens
      the prefix cache served;
    - `output`: the engine's `RequestOutput` the piece came from (its tokens and logprobs);
    - `echo`, `index`: below;
    - `reasoning`: thinking text (between `<think>` and `</think>`), when the model thinks and
      the router's reasoning parser is on;
    - `tool_calls`: fragments of the tool calls the text held (`ToolCallDelta`).
    """

    text: str
    finish_reason: str | None
    num_tokens: int
    num_cached_tokens: int = 0
    output: RequestOutput | None = None
    echo: tuple[int, ...] = ()
    """An echoed completion's first piece: the prompt's first token id (its text leads
    `text`; the rest of the prompt's tokens are scored in `output.prompt_logprobs`)."""
    index: int = 0
    """The choice it belongs to (`n` > 1: each choice's pieces come in order, the choices'
    interleaved)."""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    @property
    def is_plain(self) -> bool:
        """Only text (no reasoning, no tool call): what the fast chunk templates render."""
        return not self.reasoning and not self.tool_calls
