"""What a Responses request may ask for and kvrail does not serve, refused by name
(`refuse_unserved`, run on the raw body before its fields are validated).

- nothing is stored, so `previous_response_id`, `conversation`, `prompt` (a stored prompt),
  `item_reference` input items, `background: true` and `store: true` are refused; `store`
  omitted is served (OpenAI's default is true, but a client that leaves it out, as the Agents
  SDK and LangChain do, asks for nothing it will miss) and the response says `store: false`;
- no tool runs on the server: tools other than `function` (web search, file search, code
  interpreter, computer use, MCP, ...) and a `tool_choice` naming one are refused, as are
  input items of their calls;
- text only: image, file and audio content parts are refused;
- `truncation: "auto"` (drop the oldest items to fit the context) is refused: kvrail never
  drops input; `include` takes only `message.output_text.logprobs`.

Each raises `kvrail_unsupported`, which `errors.validation_error` reports with `code:
unsupported_parameter` and the field's dotted path as `param`.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

from kvrail.router.api.responses_api.items import item_type

LOGPROBS_INCLUDE = "message.output_text.logprobs"
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
"""The input items served; any other type is refused by name."""
_PART_TYPES = ("input_text", "output_text")
_NOT_STORED = "kvrail stores no responses (it is stateless): send the whole conversation in `input`"
_NO_HOSTED_TOOLS = (
    "kvrail runs no hosted tools (web search, file search, code interpreter, computer use, MCP, "
    "...): declare function tools and run them in the client"
)
# Top-level fields served only with the neutral value: the value refused -> why.
_NULL_ONLY: dict[str, str] = {
    "previous_response_id": _NOT_STORED,
    "conversation": "kvrail stores no conversations (it is stateless): send the whole "
    "conversation in `input`",
    "prompt": "kvrail stores no prompt templates: send the instructions and input themselves",
    "context_management": "kvrail does not compact context",
    "moderation": "kvrail runs no moderation",
    "image": "kvrail serves text only",
    "access_programs": "kvrail has no access programs",
    "background_options": "kvrail does not run responses in the background",
    "prompt_cache_options": "kvrail caches prompt prefixes on its own (no options)",
    "prompt_cache_retention": "kvrail caches prompt prefixes on its own (no retention policy)",
}


def refused(message: str, param: str) -> PydanticCustomError:
    """A refusal of something the Responses API has and kvrail does not serve, naming the
    field (`param`, a dotted path)."""
    return PydanticCustomError("kvrail_unsupported", message, {"param": param})


def refuse_unserved(data: Any) -> None:
    """Refuse, by name and before anything else is validated, what the Responses API has
    and kvrail does not serve (the module docstring lists it)."""
    if not isinstance(data, dict):
        return
    for name, why in _NULL_ONLY.items():
        if data.get(name) is not None:
            raise refused(f"'{name}' is not supported: {why}", name)
    if data.get("store") is True:
        raise refused(f"'store: true' is not supported: {_NOT_STORED} (omit store or "
                      "send false)", "store")  # fmt: skip
    if data.get("background") is True:
        raise refused("'background: true' is not supported: kvrail answers every "
                      "response as it is generated", "background")  # fmt: skip
    if data.get("truncation") == "auto":
        raise refused("'truncation: auto' is not supported: kvrail never drops input to "
                      "fit the context (send 'disabled')", "truncation")  # fmt: skip
    include = data.get("include")
    for i, value in enumerate(include if isinstance(include, list) else ()):
        if isinstance(value, str) and value != LOGPROBS_INCLUDE:
            raise refused(f"include {value[:64]!r} is not supported (only "
                          f"{LOGPROBS_INCLUDE!r})", f"include.{i}")  # fmt: skip
    _refuse_tools(data.get("tools"), data.get("tool_choice"))
    _refuse_items(data.get("input"))


def _refuse_items(items: Any) -> None:
    """Refuse input items and content parts of the types kvrail does not serve, by path."""
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        kind = item_type(item)
        if kind is None:
            raise PydanticCustomError(
                "kvrail_invalid", "an input item is an object with a 'type' (or a message's "
                "'role')", {"param": f"input.{i}"},
            )  # fmt: skip
        if kind == "item_reference":
            raise refused(f"item references are not supported: {_NOT_STORED}", f"input.{i}")
        if kind not in ITEM_TYPES:
            also = f": {_NO_HOSTED_TOOLS}" if kind.endswith(("_call", "_output")) else ""
            raise refused(f"input items of type {kind[:64]!r} are not supported (only "
                          f"{', '.join(ITEM_TYPES)}){also}", f"input.{i}.type")  # fmt: skip
        parts = item.get("content") if kind == "message" else item.get("output")
        field = "content" if kind == "message" else "output"
        allowed = _PART_TYPES if kind == "message" else ("input_text",)
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            part_type = part.get("type") if isinstance(part, dict) else None
            if isinstance(part_type, str) and part_type not in allowed:
                raise refused(f"content parts of type {part_type[:64]!r} are not supported "
                              f"(kvrail serves text only: {', '.join(allowed)})",
                              f"input.{i}.{field}.{j}.type")  # fmt: skip


def _refuse_tools(tools: Any, choice: Any) -> None:
    """Refuse hosted tools, and a `tool_choice` naming one, by path."""
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise refused(f"tools of type {kind[:64]!r} are not supported: {_NO_HOSTED_TOOLS}",
                          f"tools.{i}.type")  # fmt: skip
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind not in ("function", "allowed_tools"):
        raise refused(f"tool_choice of type {kind[:64]!r} is not supported: {_NO_HOSTED_TOOLS}",
                      "tool_choice.type")  # fmt: skip
