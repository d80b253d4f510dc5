"""A client's JSON schema checked before any grammar library sees it (`schema_text`).

The checks bound what a hostile schema can cost and name what is wrong, in the field at fault:
- nesting: at most `MAX_SCHEMA_DEPTH` levels of JSON (arrays and objects), walked without
  recursion, so no depth reaches Python's recursion limit (the grammar library refuses far less
  deep schemas anyway: about 60 levels of objects);
- references: only local ones (`#`, `#/...`), each pointing at something in the schema itself;
  a remote one is never fetched;
- size: at most `MAX_SCHEMA_BYTES` bytes as compact JSON (the form that travels), which keeps
  every compile well under a second (bench/studies/grammar: a 1 MB schema took 3.9 s).

The canonical text keeps the schema's key order (a JSON schema's property order is the order
the model writes them in), so equal schemas as sent share a cache entry. Messages never quote
more than a short, printable cut of the client's text.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from kvrail.errors import InvalidRequestError

MAX_SCHEMA_BYTES = 256 * 1024
MAX_SCHEMA_DEPTH = 100  # JSON levels: about 50 of nested objects (two levels each)
MAX_TEXT_BYTES = 64 * 1024  # a regex, a grammar, or the choices of a `choice`


def quoted(text: str, limit: int = 64) -> str:
    """A client's text cut short and printable, fit to quote in an error message."""
    cut = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return repr(cut + "..." if len(text) > limit else cut)


def schema_text(schema: Any, param: str) -> str:
    """The schema as compact JSON text, once it passed the checks in the module docstring.
    Raises InvalidRequestError naming `param`."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param)
    refs = _walk(schema, param)
    for ref in refs:
        if not ref.startswith("#"):
            raise InvalidRequestError(
                f"{param} refers to {quoted(ref)}: only references inside the schema (#/...) "
                "are supported", param,
            )  # fmt: skip
        if not _resolves(schema, ref):
            raise InvalidRequestError(
                f"{param} refers to {quoted(ref)}, which is not in the schema", param
            )
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise InvalidRequestError(f"{param} holds a number JSON cannot state", param) from None
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            f"{param} is {size:,} bytes as compact JSON; at most {MAX_SCHEMA_BYTES:,}", param
        )
    return text


def check_text(text: str, param: str, what: str) -> str:
    """A regex or grammar text within `MAX_TEXT_BYTES`. Raises InvalidRequestError."""
    size = len(text.encode())
    if size > MAX_TEXT_BYTES:
        raise InvalidRequestError(
            f"{param}: the {what} is {size:,} bytes; at most {MAX_TEXT_BYTES:,}", param
        )
    if not text:
        raise InvalidRequestError(f"{param}: the {what} is empty", param)
    return text


def _walk(schema: dict[str, Any], param: str) -> list[str]:
    """Every `$ref` value in the schema, after checking its depth (iteratively)."""
    refs: list[str] = []
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(
                f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep", param
            )
        if isinstance(value, dict):
            ref = value.get("$ref")
            if ref is not None:
                if not isinstance(ref, str):
                    raise InvalidRequestError(f"{param} has a $ref that is not a string", param)
                refs.append(ref)
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        else:
            stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))
    return refs


def _resolves(schema: dict[str, Any], ref: str) -> bool:
    """Whether the local reference `ref` (`#` and a JSON pointer) points at a value of `schema`."""
    pointer = unquote(ref[1:])
    if not pointer:
        return True
    if not pointer.startswith("/"):
        return False  # a plain-name fragment (an `$anchor`): not supported
    node: Any = schema
    for raw in pointer[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True
