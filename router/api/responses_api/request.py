"""POST /v1/responses: the request body, as far as a stateless server serves OpenAI's Responses
API (its input items are in `items`).

Strict like the chat and completion bodies (`kvrail.router.api.schemas`): no coercion, no
unknown field, and what kvrail cannot do is refused by name with a 400, never ignored
(`refusals`, run on the raw body before its fields are validated).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvrail.router.api.agent_fields import FunctionName, JsonObjectFormat, TextFormat
from kvrail.router.api.fields import STRICT, OnlyFalse
from kvrail.router.api.responses_api.items import Input, Text, by_type
from kvrail.router.api.responses_api.refusals import LOGPROBS_INCLUDE, refuse_unserved
from kvrail.sampling import MAX_LOGPROBS

MAX_METADATA_PAIRS = 16  # OpenAI's bounds on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class FunctionTool(BaseModel):
    """A function the model may call; the client runs it."""

    model_config = STRICT
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str


class AllowedTools(BaseModel):
    """Only these of `tools` may be called, `mode` as `tool_choice` says it."""

    model_config = STRICT
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[ToolChoiceFunction] = Field(min_length=1)


ToolChoiceObject = Annotated[
    Annotated[ToolChoiceFunction, Tag("type[function]")]
    | Annotated[AllowedTools, Tag("type[allowed_tools]")],
    by_type("tool_choice"),
]
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[ToolChoiceObject, Tag("dict")],
    Discriminator(lambda v: "dict" if isinstance(v, dict) else "str"),
]


class FormatJsonSchema(BaseModel):
    """The answer is JSON valid against `schema` (`schema_` here: the name is pydantic's)."""

    model_config = STRICT
    type: Literal["json_schema"]
    name: FunctionName
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = STRICT
    format: Annotated[
        Annotated[TextFormat, Tag("type[text]")]
        | Annotated[JsonObjectFormat, Tag("type[json_object]")]
        | Annotated[FormatJsonSchema, Tag("type[json_schema]")],
        by_type("text.format"),
    ] | None = None  # fmt: skip
    verbosity: None = None


class ReasoningConfig(BaseModel):
    """`effort` goes to the chat template as the chat's `reasoning_effort`; kvrail writes no
    summaries (a reasoning item's `summary` stays empty; its `content` holds the reasoning)."""

    model_config = STRICT
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(BaseModel):
    model_config = STRICT
    include_obfuscation: bool | None = Field(None, description="accepted; kvrail never pads")


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = STRICT
    model: str
    input: Input
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: OnlyFalse | None = Field(None, description="omitted or false: nothing is stored")
    background: OnlyFalse | None = None
    truncation: Literal["disabled"] | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description=f"with `include: [{LOGPROBS_INCLUDE!r}]`: the most likely tokens at each "
        "position",
    )  # fmt: skip
    metadata: dict[str, str] | None = Field(None, description="echoed in the response")
    user: str | None = Field(None, description="echoed in the response")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored")
    service_tier: Literal["auto", "default"] | None = None
    max_tool_calls: int | None = Field(
        None, ge=1, description="accepted: it bounds hosted tools' calls, and kvrail runs none"
    )
    previous_response_id: None = None
    conversation: None = None
    prompt: None = None
    context_management: None = None
    moderation: None = None
    image: None = None
    access_programs: None = None
    background_options: None = None
    prompt_cache_options: None = None
    prompt_cache_retention: None = None

    @model_validator(mode="before")
    @classmethod
    def _refusals(cls, data: Any) -> Any:
        refuse_unserved(data)  # by name, before anything else is validated
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise PydanticCustomError("kvrail_invalid", "input must not be empty")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise PydanticCustomError(
                "kvrail_invalid", f"metadata holds at most {MAX_METADATA_PAIRS} pairs"
            )
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(text) > MAX_METADATA_VALUE_CHARS:
                raise PydanticCustomError(
                    "kvrail_invalid", f"metadata keys are at most {MAX_METADATA_KEY_CHARS} "
                    f"characters and values at most {MAX_METADATA_VALUE_CHARS}",
                )  # fmt: skip
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "kvrail_invalid", "stream_options is only allowed when stream is true",
                {"param": "stream_options"},
            )  # fmt: skip
        names = {tool.name for tool in self.tools or ()}
        choice = self.tool_choice
        if choice == "required" and not names:
            raise PydanticCustomError(
                "kvrail_invalid", "tool_choice 'required' needs tools", {"param": "tool_choice"}
            )
        chosen = (
            [choice.name] if isinstance(choice, ToolChoiceFunction)
            else [t.name for t in choice.tools] if isinstance(choice, AllowedTools)
            else []
        )  # fmt: skip
        for name in chosen:
            if name not in names:
                raise PydanticCustomError(
                    "kvrail_invalid", f"tool_choice names {name[:64]!r}, which is not in tools",
                    {"param": "tool_choice"},
                )  # fmt: skip
        return self

    @property
    def asks_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())
