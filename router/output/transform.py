"""The one step between a choice's text pieces and the renderers: each piece's text split into
content, reasoning and tool-call deltas, as the request's `OutputPlan` says (`parse_pieces`).

`kvrail.router.generate` applies it to each choice's pieces on their own (so `n` > 1 parses
every choice apart), before they are merged and rendered; a request without a plan skips it
and its pieces stay text only. The last piece of a choice that made tool calls and ended by
itself has the finish reason `tool_calls`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from kvrail.router.output.piece import Piece, ToolCallDelta
from kvrail.router.output.reasoning import ReasoningSplitter
from kvrail.router.output.tool_calls import ParserName, new_call_id, tool_call_parser


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """How a request's text is parsed.

    `reasoning`: None (no reasoning parser: all text is content), `opened` (the prompt ends
    inside `<think>`: the output starts thinking) or `may_open` (the output thinks if it opens
    with `<think>`). `tool_parser`: the family whose tool calls are parsed from the answer, or
    None (no tools, or `tool_choice: none`). `parallel_tool_calls`: False keeps the first call
    only."""

    reasoning: str | None = None
    tool_parser: ParserName | None = None
    parallel_tool_calls: bool = True

    @property
    def is_plain(self) -> bool:
        return self.reasoning is None and self.tool_parser is None


async def parse_pieces(
    pieces: AsyncGenerator[Piece, None], plan: OutputPlan, new_id: Callable[[], str] = new_call_id
) -> AsyncGenerator[Piece, None]:
    """One choice's pieces, each with its text split as `plan` says (see the module docstring).
    A piece keeps its tokens, logprobs and counts; only `text`, `reasoning`, `tool_calls` and
    the last piece's `finish_reason` change."""
    splitter = ReasoningSplitter(plan.reasoning == "opened") if plan.reasoning else None
    tools = (
        tool_call_parser(plan.tool_parser, plan.parallel_tool_calls, new_id)
        if plan.tool_parser
        else None
    )
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            last = piece.finish_reason is not None
            reasoning, content = "", piece.text
            if splitter is not None:
                reasoning, content = splitter.feed(piece.text)
                if last:
                    more_reasoning, more_content = splitter.flush()
                    reasoning, content = reasoning + more_reasoning, content + more_content
            calls: list[ToolCallDelta] = []
            finish = piece.finish_reason
            if tools is not None:
                content, calls = tools.feed(content)
                if last:
                    more, more_calls = tools.flush()
                    content, calls = content + more, calls + more_calls
                    if finish == "stop" and tools.num_calls:
                        finish = "tool_calls"
            yield dataclasses.replace(
                piece, text=content, reasoning=reasoning, finish_reason=finish,
                tool_calls=ToolCallDelta.merged(calls),
            )  # fmt: skip
