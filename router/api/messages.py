"""The OpenAI API at kvrail's edge: a chat's messages (`ChatMessage`), and what the chat
template is given of them (`template_message`).

A message's `content` is a string or a list of text parts. An assistant message of the history
may state the tool calls it made (`tool_calls`; its content may then be null or left out) and
its reasoning (`reasoning_content`, or vLLM's newer `reasoning`); a `tool` message answers one
call (`tool_call_id`). `name` is passed to the chat template, which may ignore it. The legacy
`function` role is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvrail.router.api.agent_fields import MessageToolCall
from kvrail.router.api.fields import STRICT, check_text, fail

_PART_TYPES = frozenset({"image_url", "input_audio", "file", "refusal"})  # quoted in messages


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


# Tagged by the input's type, so an error inside a part is reported at its own path.
Content = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[TextPart], Tag("list")],
    Discriminator(lambda v: "str" if isinstance(v, str) else "list"),
]


class ChatMessage(BaseModel):
    """One message (see the module docstring)."""

    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = Field(description="null or omitted only for an assistant's calls")
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=128)] | None = Field(
        None, description="an assistant message's calls"
    )
    tool_call_id: Annotated[str, Field(max_length=256)] | None = Field(
        None, description="the call a tool message answers"
    )
    reasoning_content: str | None = Field(None, description="an assistant message's reasoning")
    reasoning: str | None = Field(None, description="vLLM's name for reasoning_content")
    refusal: None = None

    @model_validator(mode="before")
    @classmethod
    def _assistant_content_may_be_left_out(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") == "assistant" and "content" not in data:
            return {**data, "content": None}
        return data

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, value: Any) -> Any:
        if value == "function":
            raise fail("role 'function' is not supported by kvrail (send role 'tool')")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role") == "assistant":
            return value  # an assistant's calls without content (checked with its calls)
        if isinstance(value, str):
            return check_text(value)
        if not isinstance(value, list):
            raise fail("content must be a string or a list of text parts")
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                what = f"'{kind}'" if kind in _PART_TYPES else "other than 'text'"
                raise fail(f"content parts of type {what} are not supported by kvrail")
            if isinstance(part, dict):
                check_text(part.get("text"))
        return value

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        assistant = self.role == "assistant"
        if self.content is None and not self.tool_calls:
            raise fail("an assistant message needs content or tool_calls")
        if self.tool_calls is not None and not assistant:
            raise fail("only assistant messages have tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise fail("a tool message needs tool_call_id, and only a tool message has one")
        if (self.reasoning_content or self.reasoning) and not assistant:
            raise fail("only assistant messages have reasoning_content")
        return self

    @property
    def text(self) -> str | None:
        """The content as one string (text parts joined by newlines, as vLLM does); None for
        an assistant's calls without content."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


def template_message(message: ChatMessage) -> dict[str, Any]:
    """What the chat template is given of a message: role, content, and the fields set among
    name, tool_calls (arguments as objects), tool_call_id and reasoning_content."""
    item: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.name is not None:
        item["name"] = message.name
    if message.tool_calls:
        item["tool_calls"] = [call.template_form() for call in message.tool_calls]
    if message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content or message.reasoning
    if reasoning:
        item["reasoning_content"] = reasoning
    return item
