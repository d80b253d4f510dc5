"""Building blocks of the `InferencePool` API models: the base model and the CEL rule helpers.

Every API model derives from `CrdModel`: snake_case in Python, camelCase in YAML (aliases), every
field documented by the docstring under it (it becomes the schema's description), unknown fields
refused, instances immutable. Cross-field rules are CEL (`x-kubernetes-validations`), declared on
the model they concern with `rules(...)`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

Quantity = Annotated[int | str, WithJsonSchema({"x-kubernetes-int-or-string": True})]
"""A Kubernetes resource quantity such as `2`, `500m` or `16Gi`."""


def rule(
    expr: str, message: str, field_path: str | None = None, reason: str | None = None
) -> dict[str, str]:
    """One `x-kubernetes-validations` entry."""
    out = {"rule": expr, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


def rules(*entries: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(entries)}


class CrdModel(BaseModel):
    """Base of every API model: camelCase aliases, unknown fields refused, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )


def sub(cls: type[CrdModel]) -> Any:
    """A nested object defaulted to `{}`; `kvrail.crd.gen` writes the default out in full."""
    return Field(default_factory=cls, json_schema_extra={"default": {}})
