"""The OpenAI API at kvrail's edge: the field types and validators the request bodies
(`schemas`) are made of. Validators raise `PydanticCustomError("kvrail_invalid", ...)`
(`fail`), whose message `errors.validation_error` reports as it is, naming the field."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema
from pydantic_core import PydanticCustomError

from kvrail.sampling import MAX_BIAS, MAX_LOGIT_BIAS

MAX_STOP_STRINGS = 4
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
"""Every body's config: no coercion (`"true"` is not a boolean), no unknown field, no NaN."""


def fail(message: str) -> PydanticCustomError:
    return PydanticCustomError("kvrail_invalid", message)


def is_false(value: bool) -> bool:
    if value:
        raise fail("must be false")
    return value


def is_true(value: bool) -> bool:
    if not value:
        raise fail("must be true")
    return value


OnlyFalse = Annotated[bool, AfterValidator(is_false), WithJsonSchema({"const": False})]
OnlyTrue = Annotated[bool, AfterValidator(is_true), WithJsonSchema({"const": True})]
EmptyList = Annotated[list[Any], Field(max_length=0)]
StopString = Annotated[str, Field(min_length=1)]
Stop = StopString | Annotated[list[StopString], Field(min_length=1, max_length=MAX_STOP_STRINGS)]


def check_text(value: Any) -> Any:
    """Lone surrogates (legal in JSON escapes) cannot be tokenized: reject them up front."""
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise fail("the text is not valid Unicode (a lone surrogate)") from None
    return value


def check_stop(value: Any) -> Any:
    if value is None:
        return value
    if isinstance(value, str):
        if not value:
            raise fail("stop must not be an empty string")
        return check_text(value)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise fail("stop must be a string or a list of strings")
    if not 1 <= len(value) <= MAX_STOP_STRINGS or not all(value):
        raise fail(f"stop must hold 1 to {MAX_STOP_STRINGS} non-empty strings")
    return [check_text(s) for s in value]


def check_logit_bias(value: Any) -> Any:
    """OpenAI's `logit_bias`: token ids (as JSON keys, so strings of digits) to a bias in
    [-100, 100], at most `MAX_LOGIT_BIAS` of them. Whether an id is in the model's vocabulary is
    the router's check (`generate.serve`), which knows the vocabulary."""
    if value is None:
        return value
    if not isinstance(value, dict):
        raise fail("logit_bias must be an object of token ids to biases")
    if len(value) > MAX_LOGIT_BIAS:
        raise fail(f"logit_bias holds {len(value)} tokens; at most {MAX_LOGIT_BIAS}")
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
            raise fail("logit_bias keys must be token ids (strings of digits)")
        numeric = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not numeric or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise fail(f"logit_bias values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
    return value
