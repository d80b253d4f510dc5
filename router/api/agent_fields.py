"""The OpenAI API at kvrail's edge: what agents and structured-output clients send, as request
fields (`schemas` declares them on the bodies).

- `tools` (function tools: name, description, parameters as a JSON schema, strict),
  `tool_choice` (`none`, `auto`, `required`, or one function by name), and the history of a
  tool conversation: an assistant message's `tool_calls`, a `tool` message's `tool_call_id`;
- `response_format` (`text`, `json_object`, `json_schema` with name, schema, strict) and vLLM's
  `structured_outputs` (exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`);
- `reasoning_effort` and vLLM's `chat_template_kwargs`, which reach the chat template.

Schemas stay plain JSON here (pydantic checks their shape only); what they may contain is the
grammar compiler's business (`kvrail.router.structured`), which names the field at fault.
Validators raise `fields.fail` messages that never quote the request's text.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvrail.router.api.fields import STRICT, OnlyFalse, fail

MAX_TOOLS = 128  # OpenAI's bound
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
JsonSchema = dict[str, Any]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
TemplateValue = bool | int | float | Annotated[str, Field(max_length=1024)]


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: FunctionName
    description: str | None = None
    parameters: JsonSchema | None = Field(
        None, description="a JSON schema object; omitted: the function takes no arguments"
    )
    strict: bool | None = Field(
        None,
        description="true: keywords the grammar engine does not implement are a 400 naming "
        "them; else they are ignored where the arguments are constrained",
    )


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class ToolName(BaseModel):
    model_config = STRICT
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: ToolName


# Tagged by the input's type ("str" and "dict" are left out of an error's field path).
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[NamedToolChoice, Tag("dict")],
    Discriminator(lambda v: "str" if isinstance(v, str) else "dict"),
]


class FunctionCall(BaseModel):
    """A call as an assistant message of the history states it: `arguments` is the JSON text of
    an object as the model wrote it (one cut short by `max_tokens` is taken too, as OpenAI takes
    any string)."""

    model_config = STRICT
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    model_config = STRICT
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"]
    function: FunctionCall

    def template_form(self) -> dict[str, Any]:
        """As chat templates take it (transformers' convention): the arguments an object, or
        their text when it is not the JSON of one."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {
            "id": self.id, "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }  # fmt: skip


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = STRICT
    name: FunctionName
    description: str | None = None
    schema_: JsonSchema | None = Field(
        None, alias="schema", description="a JSON schema object; omitted: any JSON object"
    )
    strict: bool | None = Field(
        None,
        description="true: keywords the grammar engine does not implement are a 400 naming "
        "them; else they are ignored",
    )


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


_FORMATS = ("text", "json_object", "json_schema")


def _format_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return f"format[{kind}]" if kind in _FORMATS else None  # "[": not in an error's field path


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("format[text]")]
    | Annotated[JsonObjectFormat, Tag("format[json_object]")]
    | Annotated[JsonSchemaFormat, Tag("format[json_schema]")],
    Discriminator(
        _format_tag,
        custom_error_type="kvrail_invalid",
        custom_error_message="response_format.type must be text, json_object or json_schema",
    ),
]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint. `json` is a schema (or its JSON
    text), `regex` a regular expression (Rust `regex` syntax), `choice` the strings allowed,
    `grammar` a Lark grammar in llguidance's dialect (or GBNF, converted), `json_object` any
    JSON object."""

    model_config = STRICT
    json_: JsonSchema | None = Field(
        None, alias="json", description="a JSON schema object, or its JSON text"
    )
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(
        None, description="true: no whitespace between the JSON's tokens"
    )
    disable_fallback: bool | None = Field(None, description="accepted: kvrail has no fallback")
    disable_additional_properties: OnlyFalse | None = None
    whitespace_pattern: None = None
    structural_tag: None = None

    @field_validator("json_", mode="before")
    @classmethod
    def _schema_text(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            raise fail("json must be a JSON schema object, or its JSON text")
        return parsed

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [
            name for name, value in (
                ("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                ("grammar", self.grammar), ("json_object", self.json_object or None),
            ) if value is not None
        ]  # fmt: skip
        if len(given) != 1:
            raise PydanticCustomError(
                "kvrail_invalid",
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object (got {len(given)})",
                {"param": "structured_outputs"},
            )
        return self


TemplateKwargs = Annotated[dict[Annotated[str, Field(max_length=64)], TemplateValue], Field(
    max_length=32,
    description="variables for the chat template (vLLM's), e.g. enable_thinking; only names "
    "the template uses, none that kvrail sets itself (messages, tools, special tokens)",
)]  # fmt: skip
