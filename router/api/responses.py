"""The OpenAI API at kvrail's edge: response bodies.

The builders (`chat_completion`, `chat_chunk`, `completion`, `completion_chunk`, `usage`,
`model_list`) return plain dicts shaped as the OpenAI API returns them, for the hot path; the
models describe the same shapes for the OpenAPI schema (tests check both against the `openai`
client). A choice's `logprobs` is null unless the request asked for them (the `logprobs` module
builds them). A chat message has `tool_calls` when the model called tools (its `content` is then
null if it wrote nothing else), and `reasoning_content` with vLLM's newer name `reasoning` when
the router's reasoning parser is on; a streamed delta says the same in pieces. `ErrorBody` is
the error format's shape (`api_errors.ApiError` builds it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from kvrail.router.output.piece import ToolCallDelta

FinishReason = Literal["stop", "length", "tool_calls"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's `logprobs`; a streamed chunk's has no `refusal`."""

    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    """null only for an echoed prompt's first token"""
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text, as the model wrote them")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the model only called tools")
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = Field(
        None, description="the model's thinking (with the router's reasoning parser on)"
    )
    reasoning: str | None = Field(None, description="vLLM's newer name for reasoning_content")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ChunkFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ChunkToolCall(BaseModel):
    """A fragment of a call: the first has its id, type and name, later ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChunkFunction


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; the optional last one (usage) has
    no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = Field(description="null in a streamed chunk only")


class Completion(BaseModel):
    """A text completion; a streamed chunk has the same shape (and object name)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def chat_completion(
    id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    usage: Mapping[str, Any],
    system_fingerprint: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint,
        "choices": [chat_choice(0, text, finish_reason, logprobs)],
        "usage": dict(usage),
    }


def chat_choice(
    index: int,
    text: str,
    finish_reason: str,
    logprobs: dict[str, Any] | None = None,
    reasoning: str | None = None,
    tool_calls: Sequence[ToolCallDelta] = (),
) -> dict[str, Any]:
    """One choice of a whole chat completion (a body lists one per choice, by `index`);
    `reasoning` None: no reasoning parser (the fields are left out; "": null); `tool_calls`:
    whole calls (`ToolCallDelta.join`)."""
    message: dict[str, Any] = {
        "role": "assistant", "content": text if text or not tool_calls else None, "refusal": None
    }  # fmt: skip
    if tool_calls:
        message["tool_calls"] = [tool_call(c) for c in tool_calls]
    if reasoning is not None:  # null when the model did not think
        message["reasoning_content"] = message["reasoning"] = reasoning or None
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def tool_call(call: ToolCallDelta) -> dict[str, Any]:
    """A whole call as a message lists it."""
    function = {"name": call.name or "", "arguments": call.arguments}
    return {"id": call.id or "", "type": "function", "function": function}


def tool_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    """A call's fragment as a streamed delta lists it: its first with id, type and name."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": delta.id, "type": "function", "function": function}


def chat_chunk(
    id: str,
    model: str,
    created: int,
    delta_text: str | None,
    role: bool = False,
    finish_reason: str | None = None,
    usage: Mapping[str, Any] | None = None,
    system_fingerprint: str | None = None,
    include_usage: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    delta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One chunk of choice `index`. The first carries `role` (and `delta_text=""`), the last a
    `finish_reason` with an empty delta; a chunk with `usage` and nothing else is the usage
    chunk (no choices). `include_usage` adds `"usage": null` to the other chunks, as OpenAI does
    when the client asked for usage. `logprobs` are those of the chunk's tokens. `delta`: more
    fields of the delta (reasoning, tool calls)."""
    out: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint,
        "choices": [],
    }
    if delta_text is not None or role or finish_reason is not None or usage is None or delta:
        fields: dict[str, Any] = {"role": "assistant"} if role else {}
        if delta_text is not None:
            fields["content"] = delta_text
        fields.update(delta or {})
        choice = {
            "index": index, "delta": fields, "logprobs": logprobs, "finish_reason": finish_reason
        }  # fmt: skip
        out["choices"].append(choice)
    if usage is not None or include_usage:
        out["usage"] = None if usage is None else dict(usage)
    return out


def completion(
    id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    usage: Mapping[str, Any],
    system_fingerprint: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint,
        "choices": [completion_choice(0, text, finish_reason, logprobs)],
        "usage": dict(usage),
    }


def completion_choice(
    index: int, text: str, finish_reason: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One choice of a whole completion (a body lists one per choice, by `index`)."""
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(
    id: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    usage: Mapping[str, Any] | None = None,
    system_fingerprint: str | None = None,
    include_usage: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One chunk of choice `index` of a streamed completion (object `text_completion`, like the
    whole one); with `usage` and nothing else it is the usage chunk (no choices). `logprobs` are
    those of the chunk's tokens."""
    out: dict[str, Any] = {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint,
        "choices": [],
    }
    if text is not None or finish_reason is not None or usage is None:
        choice = {
            "text": text or "", "index": index, "logprobs": logprobs,
            "finish_reason": finish_reason,
        }  # fmt: skip
        out["choices"].append(choice)
    if usage is not None or include_usage:
        out["usage"] = None if usage is None else dict(usage)
    return out


def model_card(id: str, created: int, owned_by: str = "kvrail") -> dict[str, Any]:
    return {"id": id, "object": "model", "created": created, "owned_by": owned_by}


def model_list(ids: Sequence[str], created: int, owned_by: str = "kvrail") -> dict[str, Any]:
    return {"object": "list", "data": [model_card(i, created, owned_by) for i in ids]}
