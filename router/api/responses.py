"""The OpenAI API at kvrail's edge: response bodies.

The builders (`chat_completion`, `chat_chunk`, `completion`, `completion_chunk`, `usage`,
`model_list`) return plain dicts shaped as the OpenAI API returns them, for the hot path; the
models describe the same shapes for the OpenAPI schema (tests check both against the `openai`
client). A choice's `logprobs` is null unless the request asked for them (the `logprobs` module
builds them). `ErrorBody` is the error format's shape (`api_errors.ApiError` builds it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length"]


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    refusal: None = None


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


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
    index: int, text: str, finish_reason: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One choice of a whole chat completion (a body lists one per choice, by `index`)."""
    message = {"role": "assistant", "content": text, "refusal": None}
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


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
) -> dict[str, Any]:
    """One chunk of choice `index`. The first carries `role` (and `delta_text=""`), the last a
    `finish_reason` with an empty delta; a chunk with `usage` and nothing else is the usage
    chunk (no choices). `include_usage` adds `"usage": null` to the other chunks, as OpenAI does
    when the client asked for usage. `logprobs` are those of the chunk's tokens."""
    out: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint,
        "choices": [],
    }
    if delta_text is not None or role or finish_reason is not None or usage is None:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if delta_text is not None:
            delta["content"] = delta_text
        choice = {
            "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason
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
