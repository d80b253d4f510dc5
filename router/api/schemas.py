"""The OpenAI API at kvrail's edge: request bodies.

Request models are strict (`"true"` is not a boolean, `1.5` is not an integer, NaN is not a
number) and forbid unknown fields, so their JSON schema (which FastAPI publishes and a fuzzer
reads) says exactly what is accepted. Fields the OpenAI API has but kvrail does not implement are
declared with only their neutral value (`functions: []`, `audio: null`, ..., listed in
`UNSUPPORTED`), so a client that sends the default still works and one that asks for the
feature gets a 400 naming the field (`api_errors.validation_error` builds it).

A chat's messages are in `messages`; tools, tool choice, response formats, vLLM's
`structured_outputs` and template variables in `agent_fields`. The error format is in
`api_errors`, response bodies in `responses`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvrail.router.api.agent_fields import (
    MAX_TOOLS,
    NamedToolChoice,
    ReasoningEffort,
    ResponseFormat,
    StructuredOutputs,
    TemplateKwargs,
    Tool,
    ToolChoice,
)
from kvrail.router.api.fields import (
    STRICT,
    EmptyList,
    OnlyFalse,
    OnlyTrue,
    Stop,
    check_logit_bias,
    check_stop,
    check_text,
    fail,
)
from kvrail.router.api.messages import ChatMessage, template_message
from kvrail.sampling import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
)

# The seed range: int64, with the top end rounded down to 2**63 - 1024, the largest int64 that a
# float states exactly (FastAPI writes the OpenAPI bounds as floats; 2**63 - 1 would read 2**63).
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1024
MAX_CHOICES = 128  # the most `n` or `best_of` a body may state; a router's own cap is its setting
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_DEFAULT_FROM_MODEL = "default: the model's generation config, else {default}"

# Feature fields that are accepted only with their neutral value -> what that value is.
UNSUPPORTED: dict[str, str] = {
    "functions": "null or [] (send tools)",
    "function_call": 'null or "none" (send tool_choice)',
    "structured_outputs.disable_additional_properties": "null or false",
    "structured_outputs.whitespace_pattern": "null",
    "structured_outputs.structural_tag": "null",
    "audio": "null",
    "modalities": '["text"]',
    "prediction": "null",
    "verbosity": "null",
    "web_search_options": "null",
    "service_tier": 'null, "auto" or "default"',
    "store": "null or false",
    "metadata": "null",
    "moderation": "null",
    "prompt_cache_retention": "null",
    "prompt_cache_options": "null",
    "suffix": "null",
    "skip_special_tokens": "true",
    "include_stop_str_in_output": "false",
}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's: usage in every chunk (with include_usage, also at the end)"
    )
    include_obfuscation: bool | None = Field(None, description="accepted; kvrail never pads")


class _GenerationRequest(BaseModel):
    """What /v1/chat/completions and /v1/completions share."""

    model_config = STRICT
    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(
        None, ge=0, le=2, description=_DEFAULT_FROM_MODEL.format(default="1")
    )
    top_p: float | None = Field(
        None, gt=0, le=1, description=_DEFAULT_FROM_MODEL.format(default="1")
    )
    stop: Stop | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    # vLLM's sampling extensions (`kvrail.sampling`), which its benchmark clients send.
    top_k: int | None = Field(
        None, ge=-1, description=_DEFAULT_FROM_MODEL.format(default="0 (-1 and 0: off)")
    )
    min_p: float | None = Field(
        None, ge=0, le=1, description=_DEFAULT_FROM_MODEL.format(default="0 (off)")
    )
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    repetition_penalty: float | None = Field(
        None, gt=0, le=10, description=_DEFAULT_FROM_MODEL.format(default="1 (off)")
    )
    skip_special_tokens: OnlyTrue | None = None
    include_stop_str_in_output: OnlyFalse | None = None
    n: int | None = Field(
        1, ge=1, le=MAX_CHOICES,
        description="choices to generate (each with its own seed stream; the prompt computed "
        "once); at most the router's `max_choices` setting",
    )  # fmt: skip
    user: str | None = Field(None, description="accepted and ignored")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored")
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, float] | None = Field(
        None, description=f"token id -> bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}], at most "
        f"{MAX_LOGIT_BIAS} tokens",
    )  # fmt: skip

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        return check_stop(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> Any:
        return check_logit_bias(value)

    @model_validator(mode="after")
    def _stream_options(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "kvrail_invalid",
                "stream_options is only allowed when stream is true",
                {"param": "stream_options"},
            )
        return self


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(
        None, description="the sampled tokens' log-probabilities (`choices[0].logprobs`)"
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="the most likely tokens at each position, with theirs; above 0 it needs "
        "`logprobs: true`",
    )  # fmt: skip
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="function tools the model may call (rendered by the chat template)"
    )
    tool_choice: ToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or one function"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per answer")
    functions: EmptyList | None = None
    function_call: Literal["none"] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: exactly one of json, regex, choice, grammar, json_object"
    )
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="given to the chat template where it takes it (see docs/router.md)"
    )
    chat_template_kwargs: TemplateKwargs | None = None
    audio: None = None
    modalities: Annotated[list[Literal["text"]], Field(max_length=1)] | None = None
    prediction: None = None
    verbosity: None = None
    web_search_options: None = None
    service_tier: Literal["auto", "default"] | None = None
    store: OnlyFalse | None = None
    metadata: None = None
    moderation: None = None
    prompt_cache_retention: None = None
    prompt_cache_options: None = None

    @model_validator(mode="after")
    def _max_tokens_agree(self) -> ChatCompletionRequest:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise PydanticCustomError(
                "kvrail_invalid",
                "max_tokens and max_completion_tokens disagree; send only max_completion_tokens",
                {"param": "max_completion_tokens"},
            )
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:  # vLLM refuses it too
            raise PydanticCustomError(
                "kvrail_invalid", "top_logprobs needs logprobs: true", {"param": "top_logprobs"}
            )
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise _invalid("tools", "two tools have the same name")
        choice = self.tool_choice
        if choice == "required" and not names:
            raise _invalid("tool_choice", "tool_choice required needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _invalid("tool_choice", "tool_choice names a function that is not in tools")
        return self

    @model_validator(mode="after")
    def _one_output_format(self) -> ChatCompletionRequest:
        return _one_format(self)

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (`messages.template_message`)."""
        return [template_message(m) for m in self.messages]


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = (
    str
    | TokenIds
    | Annotated[list[str], Field(min_length=1, max_length=1)]
    | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
)


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt, as a string, a list of token ids, `[string]` or
    `[[token ids]]`. `max_tokens` defaults to 16 (OpenAI's default); `null` means as many as the
    context allows. `echo` returns the prompt before the completion, and with `logprobs` the
    prompt's tokens scored too (the first has none, as in OpenAI's API)."""

    prompt: Prompt
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: exactly one of json, regex, choice, grammar, json_object"
    )
    echo: bool | None = Field(
        None, description="return the prompt before the completion (with `logprobs`: scored)"
    )
    suffix: None = None
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="the sampled tokens' log-probabilities, with this many most likely tokens "
        "at each position",
    )  # fmt: skip
    best_of: int | None = Field(
        None, ge=1, le=MAX_CHOICES,
        description="completions to generate, of which the `n` likeliest per token are returned "
        "(not streamed); at least `n`",
    )  # fmt: skip

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < (self.n or 1):  # vLLM refuses it too
            raise PydanticCustomError(
                "kvrail_invalid", "best_of must be at least n", {"param": "best_of"}
            )
        if self.best_of is not None and self.best_of > (self.n or 1) and self.stream:
            raise PydanticCustomError(
                "kvrail_invalid", "best_of above n cannot be streamed (the best are known only "
                "at the end)", {"param": "best_of"},
            )  # fmt: skip
        return self

    @model_validator(mode="after")
    def _one_output_format(self) -> CompletionRequest:
        return _one_format(self)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            return check_text(value)
        if isinstance(value, list):
            if not value:
                raise fail("prompt must not be empty")
            if len(value) > 1 and all(isinstance(p, str | list) for p in value):
                raise fail("batches of several prompts are not supported by kvrail")
            if isinstance(value[0], list):
                if not value[0] or not all(type(t) is int and t >= 0 for t in value[0]):
                    raise fail("prompt token ids must be integers >= 0")
            elif isinstance(value[0], str):
                check_text(value[0])
            elif not all(type(t) is int and t >= 0 for t in value):
                raise fail("prompt token ids must be integers >= 0")
        return value

    @property
    def prompt_text(self) -> str | None:
        """The prompt string, or None when the prompt is token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p
        return p[0] if isinstance(p[0], str) else None

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt token ids, or None when the prompt is text."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], str):
            return None
        ids = p[0] if isinstance(p[0], list) else p
        return [int(t) for t in ids]


def _invalid(param: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("kvrail_invalid", message, {"param": param})


RequestBody = TypeVar("RequestBody", ChatCompletionRequest, CompletionRequest)


def _one_format(body: RequestBody) -> RequestBody:
    """A `structured_outputs` and a `response_format` other than text are two answers to one
    question: refused (vLLM lets structured_outputs win)."""
    kind = body.response_format.type if body.response_format is not None else "text"
    if body.structured_outputs is not None and kind != "text":
        raise _invalid("structured_outputs", "send structured_outputs or response_format, not both")
    return body
