"""A Responses API request as the chat completion that serves it (`Translation.of`).

Pure: a validated `ResponsesRequest` in, the chat completions body out (a dict, validated as
`ChatCompletionRequest` by `Translation.chat_request`), with what it takes to name a chat
field's problem by the Responses field it came from (`Translation.renamed`):

- `instructions` -> a leading system message; `input` as a string -> one user message;
- message items -> messages of the same role (content parts joined by newlines, as chat text
  parts are); `function_call` items -> an assistant message's `tool_calls` (consecutive calls,
  and calls right after an assistant message, join that message: one turn of the model);
  `function_call_output` items -> `tool` messages; a `reasoning` item's text -> the next
  assistant message's `reasoning_content` (templates that keep a turn's thinking, as Qwen3's
  does within a tool loop, get it back; reasoning before no assistant turn is dropped);
- function `tools` -> chat function tools; `tool_choice` as it is, a named function as chat
  names one, `allowed_tools` -> those tools only, with its mode;
- `text.format` -> `response_format`; `reasoning.effort` -> `reasoning_effort`;
  `max_output_tokens` -> `max_completion_tokens`; `include: [message.output_text.logprobs]`
  (with `top_logprobs`) -> `logprobs` (and `top_logprobs`); sampling fields as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvrail.router.api.agent_fields import JsonObjectFormat
from kvrail.router.api.errors import ApiError, validation_error
from kvrail.router.api.responses_api.items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ReasoningItem,
)
from kvrail.router.api.responses_api.request import (
    AllowedTools,
    FormatJsonSchema,
    FunctionTool,
    ResponsesRequest,
    ToolChoiceFunction,
)
from kvrail.router.api.schemas import ChatCompletionRequest

# Chat fields -> the Responses fields they come from (messages and tools: by index, below).
_RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",  # the router's own checks name it so
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "logprobs": "include",
    "prompt": "input",
}
_COPIED = ("temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier",
           "prompt_cache_key", "service_tier")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Translation:
    """The chat body of one Responses request, and where each of its messages and tools came
    from (`message_params[k]`: the Responses field chat message k was made of)."""

    body: dict[str, Any]
    message_params: tuple[str, ...]
    tool_params: tuple[str, ...]

    @classmethod
    def of(cls, req: ResponsesRequest) -> Translation:
        messages, message_params = _messages(req)
        body: dict[str, Any] = {"model": req.model, "messages": messages}
        body["stream"] = bool(req.stream)
        for name in _COPIED:
            value = getattr(req, name)
            if value is not None:
                body[name] = value
        if req.max_output_tokens is not None:
            body["max_completion_tokens"] = req.max_output_tokens
        tools, tool_params = _tools(req)
        if tools is not None:
            body["tools"] = tools
        choice = req.tool_choice
        if isinstance(choice, AllowedTools):
            body["tool_choice"] = choice.mode
        elif isinstance(choice, ToolChoiceFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        response_format = _response_format(req)
        if response_format is not None:
            body["response_format"] = response_format
        if req.reasoning is not None and req.reasoning.effort is not None:
            body["reasoning_effort"] = req.reasoning.effort
        if req.asks_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = req.top_logprobs or 0
        elif req.top_logprobs:
            raise ApiError(
                400, "top_logprobs needs include: ['message.output_text.logprobs']",
                param="top_logprobs",
            )  # fmt: skip
        return cls(body, tuple(message_params), tuple(tool_params))

    def chat_request(self) -> ChatCompletionRequest:
        """The chat body validated. Raises ApiError naming the Responses field at fault."""
        try:
            return ChatCompletionRequest.model_validate(self.body)
        except ValidationError as err:
            raise self.renamed(validation_error(err)) from None

    def renamed(self, err: ApiError) -> ApiError:
        """`err` with its `param` (a chat field, as the chat path names it) named as the
        Responses field it came from."""
        param = self.responses_param(err.param)
        if param == err.param:
            return err
        return ApiError(err.status, err.message, err.type, param, err.code, err.headers)

    def responses_param(self, param: str | None) -> str | None:
        """The Responses field a chat field (dotted path) came from."""
        if param is None:
            return None
        head, _, rest = param.partition(".")
        index, _, tail = rest.partition(".")
        if head == "messages":  # a message stands for an item (or the instructions)
            known = index.isdigit() and int(index) < len(self.message_params)
            return self.message_params[int(index)] if known else "input"
        if head == "tools" and index.isdigit() and int(index) < len(self.tool_params):
            tail = tail.removeprefix("function").removeprefix(".")
            base = self.tool_params[int(index)]
            return f"{base}.{tail}" if tail else base
        if head == "response_format":
            tail = rest.removeprefix("json_schema").removeprefix(".")
            return f"text.format.{tail}" if tail else "text.format"
        if head == "tool_choice":
            return "tool_choice"
        return _RENAMED.get(head, head) + (f".{rest}" if rest and head not in _RENAMED else "")


def _messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages of the instructions and input, with the field each came from."""
    messages: list[dict[str, Any]] = []
    params: list[str] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
        params.append("instructions")
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        params.append("input")
        return messages, params
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(req.input):
        if isinstance(item, ReasoningItem):
            reasoning = "\n".join(part.text for part in item.content or ()) or None
            continue
        last = messages[-1] if messages else None
        if isinstance(item, FunctionCallItem) and last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(_call(item))  # the same turn of the model
        elif isinstance(item, FunctionCallItem):
            messages.append({"role": "assistant", "tool_calls": [_call(item)]})
            params.append(f"input.{i}")
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
            params.append(f"input.{i}")
        else:
            messages.append({"role": item.role, "content": item.text})
            params.append(f"input.{i}")
        if messages[-1]["role"] == "assistant" and reasoning is not None:
            messages[-1].setdefault("reasoning_content", reasoning)
        reasoning = None  # reasoning not followed by the model's turn is not put back
    return messages, params


def _call(item: FunctionCallItem) -> dict[str, Any]:
    return {
        "id": item.call_id, "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }  # fmt: skip


def _tools(req: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """The chat tools (those `allowed_tools` allows, when it is the choice), with the field each
    came from."""
    if req.tools is None:
        return None, []
    allowed: Sequence[str] | None = None
    if isinstance(req.tool_choice, AllowedTools):
        allowed = [t.name for t in req.tool_choice.tools]
    tools, params = [], []
    for i, tool in enumerate(req.tools):
        if allowed is None or tool.name in allowed:
            tools.append(chat_tool(tool))
            params.append(f"tools.{i}")
    return tools, params


def chat_tool(tool: FunctionTool) -> dict[str, Any]:
    """A function tool as chat declares it."""
    function: dict[str, Any] = {"name": tool.name}
    for name in ("description", "parameters", "strict"):
        value = getattr(tool, name)
        if value is not None:
            function[name] = value
    return {"type": "function", "function": function}


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, JsonObjectFormat):
        return {"type": "json_object"}
    if isinstance(fmt, FormatJsonSchema):
        schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.description is not None:
            schema["description"] = fmt.description
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": schema}
    return None  # text: the chat default
