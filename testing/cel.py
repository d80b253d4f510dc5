"""Evaluate the CRD's CEL rules in-process, as the API server would, for tests and examples.

The API server first applies the schema's defaults, then evaluates each `x-kubernetes-validations`
rule with `self` bound to the value at that node (only where the value is present). This module
does the same with cel-python (a development dependency, imported lazily), so the rules' logic is
unit-tested without a server. It does not replace the cluster tests: Kubernetes' CEL library has
extensions and cost limits cel-python lacks. The rules use standard CEL, and of Kubernetes'
extensions only the part of the quantity library below (`quantity`, `isQuantity`, `compareTo`,
`isGreaterThan`, `isLessThan`), which this module provides with the same meaning.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from typing import Any

from kvrail.crd.gen import openapi_schema
from kvrail.crd.quantity import parse_quantity


@dataclass(frozen=True, slots=True)
class Violation:
    """A rule that evaluated to false: where, which rule, and the message users see."""

    path: str
    rule: str
    message: str


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Return a copy of `value` with the schema's defaults filled in, recursively (as the API
    server does: a defaulted object gets its own properties' defaults too)."""
    value = copy.deepcopy(value)
    _default(schema, value)
    return value


def violations(manifest: dict[str, Any], schema: dict[str, Any] | None = None) -> list[Violation]:
    """Every CEL rule of the InferencePool schema that `manifest` (after defaulting) breaks."""
    schema = schema if schema is not None else _schema()
    obj = apply_defaults(schema, manifest)
    out: list[Violation] = []
    _walk(schema, obj, "", out)
    return out


@cache
def _schema() -> dict[str, Any]:
    return openapi_schema()


def _default(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for item in value.values():
                _default(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(schema["items"], item)


def _walk(schema: dict[str, Any], value: Any, path: str, out: list[Violation]) -> None:
    for entry in schema.get("x-kubernetes-validations", []):
        if not _evaluate(entry["rule"], value):
            where = path + entry.get("fieldPath", "")
            out.append(Violation(where, entry["rule"], entry["message"]))
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                _walk(sub, value[name], f"{path}.{name}", out)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                _walk(extra, item, f"{path}[{key!r}]", out)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _walk(schema["items"], item, f"{path}[{i}]", out)


def _evaluate(rule: str, value: Any) -> bool:
    # cel-python is a development dependency: only tests evaluate CEL in-process.
    from celpy.adapter import json_to_cel
    from celpy.evaluation import CELEvalError

    result = _program(rule).evaluate({"self": json_to_cel(value)})
    if isinstance(result, CELEvalError):
        raise ValueError(f"CEL rule {rule!r} failed to evaluate: {result}")
    return bool(result)


@cache
def _program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule), functions=_quantity_library())


class _Quantity:
    """A value of Kubernetes' CEL `Quantity` type: comparable only through its methods (CEL's
    `<` does not apply to it on the API server, so it does not here either)."""

    def __init__(self, value: Fraction) -> None:
        self.value = value


def _quantity_library() -> dict[str, Any]:
    from celpy import celtypes

    def quantity(text: Any) -> _Quantity:
        return _Quantity(parse_quantity(str(text)))

    def is_quantity(text: Any) -> Any:
        try:
            parse_quantity(str(text))
        except ValueError:
            return celtypes.BoolType(False)
        return celtypes.BoolType(True)

    def compare_to(a: _Quantity, b: _Quantity) -> Any:
        return celtypes.IntType((a.value > b.value) - (a.value < b.value))

    return {
        "quantity": quantity,
        "isQuantity": is_quantity,
        "compareTo": compare_to,
        "isGreaterThan": lambda a, b: celtypes.BoolType(a.value > b.value),
        "isLessThan": lambda a, b: celtypes.BoolType(a.value < b.value),
    }
