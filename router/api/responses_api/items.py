"""A Responses request's input items (OpenAI's Responses API): messages, function calls and
their outputs, reasoning, and their text content parts.

An item's `type` picks its model (a message may leave it out: it has a `role`); the types kvrail
does not serve never reach these models (`refusals` refuses them by name first). Tags are in
brackets, as pydantic writes its own, so that an error names the field, not the tag
(`errors.validation_error` drops them from the path).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Discriminator, Field, Tag

from kvrail.router.api.fields import STRICT, check_text

Text = Annotated[str, BeforeValidator(check_text)]
"""Client text: lone surrogates (legal in JSON escapes) cannot be tokenized, so they are refused."""


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


def by_type(what: str) -> Discriminator:
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
    by_type("a content part"),
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
    """An earlier turn's reasoning, as a client replays a response's output: its `content`
    becomes the next assistant message's `reasoning_content` (`translate`); a `summary` is
    accepted and not used (it is not the reasoning)."""

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
    Discriminator(lambda v: f"item[{item_type(v)}]"),  # types not served: refused before
]
Input = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[InputItem], Tag("list")],
    Discriminator(lambda v: "str" if isinstance(v, str) else "list"),
]


def item_type(item: Any) -> str | None:
    """An input item's type: its `type`, or `message` for one that has a role and no type."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if kind is None and "role" in item:
        return "message"
    return kind if isinstance(kind, str) else None
