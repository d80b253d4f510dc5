"""A Response object (OpenAI's Responses API) and its output items.

The builders return plain dicts, shaped as the `openai` client's `openai.types.responses`
parse them; the models describe the same shapes for the OpenAPI document
(`tests/unit/router/test_responses_api.py` holds both against the client's types). Ids are
OpenAI's kinds: `resp_...` for the response, `msg_...`, `rs_...`, `fc_...` for its items, made
from the response's own random part so that one response's ids never collide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from kvrail.router.api.responses_api.request import ResponsesRequest
from kvrail.router.api.sampling import Defaults

Status = Literal["completed", "failed", "in_progress", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputTextPart(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[dict[str, Any]]


class MessageOutput(BaseModel):
    id: str
    type: Literal["message"]
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputTextPart]


class FunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call"]
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningOutput(BaseModel):
    id: str
    type: Literal["reasoning"]
    status: ItemStatus
    summary: list[Any] = Field(description="always empty: kvrail writes no summaries")
    content: list[ReasoningTextPart]


OutputItem = Annotated[
    MessageOutput | FunctionCallOutput | ReasoningOutput, Field(discriminator="type")
]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = Field(
        description="always 0: kvrail's prefix cache keeps blocks on its own, no request writes"
    )


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: Literal["server_error", "rate_limit_exceeded", "invalid_prompt"]
    message: str
    type: str
    param: str | None


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response; the request's fields it restates are as the request set them, or the
    defaults that applied."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Status
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    parallel_tool_calls: bool
    previous_response_id: None
    reasoning: dict[str, Any]
    service_tier: str
    store: Literal[False]
    background: Literal[False]
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int
    truncation: Literal["disabled"]
    user: str | None
    metadata: dict[str, str]
    prompt_cache_key: str | None
    safety_identifier: str | None


def restated(req: ResponsesRequest, defaults: Defaults) -> dict[str, Any]:
    """The request's fields a Response restates: as sent, or the default that applies
    (`defaults`: the router's sampling defaults, for an omitted temperature or top_p)."""
    text_format = req.text.format if req.text is not None else None
    reasoning = req.reasoning
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": reasoning.summary if reasoning else None,
        },
        "service_tier": req.service_tier or "default",
        "store": False,
        "background": False,
        "temperature": defaults.temperature if req.temperature is None else req.temperature,
        "top_p": defaults.top_p if req.top_p is None else req.top_p,
        "text": {"format": text_format_of(text_format)},
        "tool_choice": tool_choice_of(req.tool_choice),
        "tools": [tool.model_dump() for tool in req.tools or ()],
        "top_logprobs": req.top_logprobs or 0,
        "truncation": "disabled",
        "user": req.user,
        "metadata": dict(req.metadata or {}),
        "prompt_cache_key": req.prompt_cache_key,
        "safety_identifier": req.safety_identifier,
    }


def text_format_of(fmt: BaseModel | None) -> dict[str, Any]:
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)


def tool_choice_of(choice: str | BaseModel | None) -> str | dict[str, Any]:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def response_object(
    response_id: str,
    created_at: int,
    model: str,
    fields: Mapping[str, Any],
    status: Status,
    output: Sequence[dict[str, Any]] = (),
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    """A Response; `fields` are those the request's `restated` gives."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "model": model,
        "output": list(output),
        "usage": usage,
        **fields,
    }


def usage(
    input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0
) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def response_error(status: int, message: str, type: str, param: str | None) -> dict[str, Any]:
    """A failed response's `error`: its code is one of OpenAI's for a response (a request
    refused midway is an `invalid_prompt`), its `type` and `param` the error's own."""
    code = "rate_limit_exceeded" if status == 429 else "server_error" if status >= 500 else (
        "invalid_prompt"
    )  # fmt: skip
    return {"code": code, "message": message, "type": type, "param": param}


def output_text(text: str, logprobs: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def message_item(
    item_id: str, status: ItemStatus, parts: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    return {
        "id": item_id, "type": "message", "status": status, "role": "assistant",
        "content": list(parts),
    }  # fmt: skip


def function_call_item(
    item_id: str, status: ItemStatus, call_id: str, name: str, arguments: str
) -> dict[str, Any]:
    return {
        "id": item_id, "type": "function_call", "status": status, "call_id": call_id,
        "name": name, "arguments": arguments,
    }  # fmt: skip


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(
    item_id: str, status: ItemStatus, parts: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """A reasoning item: the thinking in its `content`, no `summary` (kvrail writes none)."""
    return {
        "id": item_id, "type": "reasoning", "status": status, "summary": [],
        "content": list(parts),
    }  # fmt: skip
