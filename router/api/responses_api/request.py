"""POST /v1/responses: the request body, as far as a stateless server serves OpenAI's Responses
API.

Strict like the chat and completion bodies (`kvrail.router.api.schemas`): no coercion, no
unknown field, and what kvrail cannot do is refused by name with a 400, never ignored:

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

Every refusal is checked in one place (`ResponsesRequest._refusals`, before the fields are
validated) and raises `kvrail_unsupported`, which `errors.validation_error` reports with
`code: unsupported_parameter` and the field's dotted path as `param`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvrail.router.api.fields import STRICT, OnlyFalse, check_text
from kvrail.sampling import MAX_LOGPROBS

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_PAIRS = 16  # OpenAI's bounds on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
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


Text = Annotated[str, BeforeValidator(check_text)]
"""Client text: lone surrogates (legal in JSON escapes) cannot be tokenized, so they are refused."""


def refused(message: str, param: str) -> PydanticCustomError:
    """A refusal of something the Responses API has and kvrail does not serve, naming the
    field (`param`, a dotted path)."""
    return PydanticCustomError("kvrail_unsupported", message, {"param": param})


class InputText(BaseModel):
    model_config = STRICT
    type: Literal["input_text"]
    text: Text


class OutputText(BaseModel):
    """A part of an earlier answer, as the client got it (`annotations` and `logprobs` are
    accepted and not used)."""

    model_config = STRICT
    type: Literal["output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _by_type(what: str) -> Discriminator:
    """Tells a union's models apart by their `type`. Tags are in brackets, as pydantic writes
    its own, so that an error names the field, not the tag (`errors.validation_error`)."""

    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else None
        return f"type[{kind}]" if isinstance(kind, str) else None

    return Discriminator(
        tag, custom_error_type="kvrail_invalid",
        custom_error_message=f"{what} is an object whose 'type' is one of those served",
    )  # fmt: skip


Part = Annotated[
    Annotated[InputText, Tag("type[input_text]")] | Annotated[OutputText, Tag("type[output_text]")],
    _by_type("a content part"),
]
Content = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[Part], Tag("list")],
    Discriminator(lambda v: "str" if isinstance(v, str) else "list"),
]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(BaseModel):
    """A message (`type` may be left out); an assistant's is an earlier answer."""

    model_config = STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @property
    def text(self) -> str:
        """The content as one string; parts are joined by newlines, as chat text parts are."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A function call the model made in an earlier turn."""

    model_config = STRICT
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: Text
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(BaseModel):
    """What the client's function returned for call `call_id`."""

    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Annotated[
        Annotated[Text, Tag("str")] | Annotated[list[InputText], Tag("list")],
        Discriminator(lambda v: "str" if isinstance(v, str) else "list"),
    ]
    id: str | None = None
    status: ItemStatus | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


class SummaryText(BaseModel):
    model_config = STRICT
    type: Literal["summary_text"]
    text: str


class ReasoningText(BaseModel):
    model_config = STRICT
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    """An earlier turn's reasoning, as a client replays a response's output. It is not put
    back into the prompt: reasoning models' chat templates drop earlier turns' thinking."""

    model_config = STRICT
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: ItemStatus | None = None


InputItem = Annotated[
    Annotated[MessageItem, Tag("item[message]")]
    | Annotated[FunctionCallItem, Tag("item[function_call]")]
    | Annotated[FunctionCallOutputItem, Tag("item[function_call_output]")]
    | Annotated[ReasoningItem, Tag("item[reasoning]")],
    # Tags in brackets, as pydantic writes its own: errors name the field, not the tag.
    Discriminator(lambda v: f"item[{_item_type(v)}]"),  # types not served: refused before
]
Input = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[InputItem], Tag("list")],
    Discriminator(lambda v: "str" if isinstance(v, str) else "list"),
]


class FunctionTool(BaseModel):
    """A function the model may call; the client runs it."""

    model_config = STRICT
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
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
    _by_type("tool_choice"),
]
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[ToolChoiceObject, Tag("dict")],
    Discriminator(lambda v: "dict" if isinstance(v, dict) else "str"),
]


class FormatText(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class FormatJsonObject(BaseModel):
    model_config = STRICT
    type: Literal["json_object"]


class FormatJsonSchema(BaseModel):
    """The answer is JSON valid against `schema` (`schema_` here: the name is pydantic's)."""

    model_config = STRICT
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = STRICT
    format: Annotated[
        Annotated[FormatText, Tag("type[text]")]
        | Annotated[FormatJsonObject, Tag("type[json_object]")]
        | Annotated[FormatJsonSchema, Tag("type[json_schema]")],
        _by_type("text.format"),
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
        """Refuse, by name and before anything else is validated, what the Responses API has
        and kvrail does not serve (the module docstring lists it)."""
        if not isinstance(data, dict):
            return data
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


def _item_type(item: Any) -> str | None:
    """An input item's type: its `type`, or `message` for one that has a role and no type."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if kind is None and "role" in item:
        return "message"
    return kind if isinstance(kind, str) else None


def _refuse_items(items: Any) -> None:
    """Refuse input items and content parts of the types kvrail does not serve, by path."""
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        kind = _item_type(item)
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
                              "(kvrail serves text only: input_text, output_text)",
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
