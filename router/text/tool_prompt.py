"""kvrail's default tool prompt, for a chat template that ignores `tools` (SmolLM2's does):
the conversation rewritten so such a template still shows the model its tools and its calls
(`with_tool_prompt`).

- The tools are stated in a system turn (added to the first system or developer message, else
  a new first message): one JSON object per function between `<tools>` and `</tools>`, and how
  to call one: a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
  `</tool_call>`, the format the `hermes` parser reads.
- An assistant message's `tool_calls` become that text after its content.
- A `tool` message becomes a user message with the result between `<tool_response>` and
  `</tool_response>` (consecutive results in one message).

All of it is message content, so the tools' text is encoded as plain text like any message.
Pure: no tokenizer here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

INSTRUCTIONS = """You can call functions to answer. Each function is described by one JSON \
object per line between <tools> and </tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments between <tool_call> and \
</tool_call>, like this:
<tool_call>
{{"name": "<function name>", "arguments": {{"<argument name>": <argument value>}}}}
</tool_call>"""


def tool_instructions(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that states `tools` (OpenAI's `{"type": "function", "function": ...}`)."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return INSTRUCTIONS.format(tools=lines)


def call_text(call: Mapping[str, Any]) -> str:
    """One call of an assistant message (`{"function": {"name", "arguments"}}`) as its text."""
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def with_tool_prompt(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` rewritten as the module docstring says; `tools` None or empty: only the
    history's calls and results are rewritten."""
    out: list[dict[str, Any]] = []
    for message in messages:
        item = dict(message)
        calls = item.pop("tool_calls", None)
        if calls:
            texts = [item.get("content") or "", *(call_text(c) for c in calls)]
            item["content"] = "\n".join(t for t in texts if t)
        if item.get("role") == "tool":
            item.pop("tool_call_id", None)
            result = f"<tool_response>\n{item.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("from_tools"):
                out[-1]["content"] += "\n" + result
                continue
            item = {"role": "user", "content": result, "from_tools": True}
        out.append(item)
    for item in out:
        item.pop("from_tools", None)
    if tools:
        text = tool_instructions(tools)
        if out and out[0].get("role") in ("system", "developer"):
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{text}" if first else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
