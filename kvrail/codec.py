"""The wire codec: how every message crossing NATS or etcd is encoded, decoded and validated.

A message is a frozen dataclass deriving from `Message` (the types are in `kvrail.messages` and
`kvrail.outputs`), encoded as JSON with its integer arrays (token and block ids) packed as base64
of little-endian int64 values; a class may have a binary form of its own as well
(`BINARY_MAGIC`; only `TokenEventBatch` does, laid out by `kvrail.binary_codec`). `decode()`
never trusts its input: a wrong version, a missing or mistyped field, a negative id or an
oversized payload raises `MessageError` and nothing else, so a hostile job on the queue is
rejected and counted without touching any request's blocks.
"""

from __future__ import annotations

import base64
import binascii
import json
import types
import typing
from array import array
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from typing import Any, ClassVar, Literal, TypeVar

from kvrail.errors import KvrailError

WIRE_VERSION = 1
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_TOKENS = 1_048_576
MAX_BLOCKS = 65_536


class MessageError(KvrailError):
    """A message could not be decoded or failed validation. The text holds no payload bytes."""


def _pack(values: tuple[int, ...], code: str) -> str:
    return base64.b64encode(array(code, values).tobytes()).decode()


def _unpack(text: object, code: str, name: str, limit: int) -> tuple[int, ...]:
    if not isinstance(text, str):
        raise MessageError(f"field {name} must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise MessageError(f"field {name} is not valid base64") from err
    itemsize = array(code).itemsize
    if len(raw) % itemsize:
        raise MessageError(f"field {name} is truncated ({len(raw)} bytes)")
    if len(raw) // itemsize > limit:
        raise MessageError(f"field {name} has more than {limit} entries")
    values = tuple(array(code, raw))
    if any(v < 0 for v in values):
        raise MessageError(f"field {name} holds a negative id")
    return values


# Fields holding id arrays: name -> (array type code, limit).
_PACKED: dict[str, tuple[str, int]] = {
    "token_ids": ("q", MAX_TOKENS),
    "dest_block_ids": ("q", MAX_BLOCKS),
    "block_ids": ("q", MAX_BLOCKS),
}


compact_json = json.JSONEncoder(separators=(",", ":")).encode
"""`json.dumps(value, separators=(",", ":"))`, without building an encoder on every call."""


@dataclass(frozen=True, slots=True)
class Message:
    kind: ClassVar[str] = ""

    def encode(self) -> bytes:
        body: dict[str, Any] = {"v": WIRE_VERSION, "kind": self.kind}
        body.update(_encode_fields(self))
        data = compact_json(body).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise MessageError(f"{self.kind} message of {len(data)} bytes exceeds the limit")
        return data


def _encode_fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as JSON values. Fields are flat (ints, floats, strings, tuples of
    them) or a nested frozen dataclass (e.g. `SamplingParams`), so they are read as they are:
    `asdict`'s recursive copy made encoding a TokenEvent take 34 us on the 2-vCPU machine,
    against 13 us, and a decode worker encodes one per running request per step."""
    body: dict[str, Any] = {}
    for name in _info(type(obj)).names:
        value = getattr(obj, name)
        if type(value) in _SCALARS:  # most fields: no further look
            body[name] = value
        elif name in _PACKED:
            body[name] = _pack(tuple(value), _PACKED[name][0])
        else:
            body[name] = encode_value(value)
    return body


_SCALARS = frozenset({str, int, float, bool, type(None)})

# Per dataclass (message or nested), computed once: the fields and, for each, a checker made
# from its type hint. `typing.get_type_hints` evaluates every annotation's string (`from
# __future__ import annotations`), and walking a hint with `typing.get_origin` for every value
# decoded cost more than the rest of decoding; a router decodes every token event it streams.
Checker = Callable[[Any, str], Any]


@dataclass(frozen=True, slots=True)
class _ClassInfo:
    fields: tuple[Field[Any], ...]
    names: tuple[str, ...]
    checkers: dict[str, Checker]
    required: frozenset[str]


_CLASS_INFO: dict[type[Any], _ClassInfo] = {}


def _info(cls: type[Any]) -> _ClassInfo:
    info = _CLASS_INFO.get(cls)
    if info is None:
        found = fields(cls)
        hints = typing.get_type_hints(cls)
        checkers = {f.name: _checker(hints[f.name]) for f in found if f.name not in _PACKED}
        required = frozenset(
            f.name for f in found if f.default is MISSING and f.default_factory is MISSING
        )
        info = _ClassInfo(found, tuple(f.name for f in found), checkers, required)
        _CLASS_INFO[cls] = info
    return info


def encode_value(value: Any) -> Any:
    """One field's value as the JSON codec writes it (a nested dataclass as an object, a tuple
    as a list of such values)."""
    if type(value) in _SCALARS:
        return value
    if is_dataclass(value) and not isinstance(value, type):
        return _encode_fields(value)
    if isinstance(value, tuple):
        return [encode_value(v) for v in value]
    return value


def field_checkers(cls: type[Any]) -> dict[str, Checker]:
    """The checker of each field of dataclass `cls` (packed id arrays excepted): what `decode`
    applies to a JSON value before it builds `cls`."""
    return _info(cls).checkers


M = TypeVar("M", bound=Message)
D = TypeVar("D")


BINARY_MAGIC = b"\x00kvrail"
"""How a message in a binary form of its own starts (never valid JSON): a class that has one
defines `decode_binary(data)`, and `decode` hands it what starts so (`TokenEventBatch`, which
the router decodes for every token it streams)."""


def decode(data: bytes, cls: type[M]) -> M:
    """Decode and validate one message of type `cls`; raises MessageError."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds the limit")
    binary = getattr(cls, "decode_binary", None)
    if binary is not None and data[: len(BINARY_MAGIC)] == BINARY_MAGIC:
        decoded: M = binary(data)
        return decoded
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MessageError("message is not valid JSON") from err
    if not isinstance(body, dict):
        raise MessageError("message is not a JSON object")
    if body.get("v") != WIRE_VERSION:
        raise MessageError(f"unsupported wire version (want {WIRE_VERSION})")
    if body.get("kind") != cls.kind:
        raise MessageError(f"expected a {cls.kind} message, got another kind")
    return _decode_fields(cls, body, f"{cls.kind} message")


def _decode_fields(cls: type[D], body: dict[str, Any], what: str) -> D:
    """Build dataclass `cls` from a JSON object, every field checked against its type hint; a
    value the class itself refuses (its `__post_init__`) is a MessageError too."""
    info = _info(cls)
    checkers = info.checkers
    values: dict[str, Any] = {}
    for name in info.names:
        if name not in body:
            if name in info.required:
                raise MessageError(f"{what} lacks field {name}")
            continue  # optional field: its default applies
        raw = body[name]
        if name in _PACKED:
            code, limit = _PACKED[name]
            values[name] = _unpack(raw, code, name, limit)
        else:
            values[name] = checkers[name](raw, name)
    try:
        return cls(**values)
    except (TypeError, ValueError, KvrailError) as err:
        raise MessageError(f"invalid {what}: {err}") from err


def _checker(hint: Any) -> Checker:
    """A function that returns a JSON value as `hint` says it must be, or raises MessageError."""
    if isinstance(hint, type) and is_dataclass(hint):

        def nested(value: Any, name: str) -> Any:
            if not isinstance(value, dict):
                raise MessageError(f"field {name} must be an object")
            return _decode_fields(hint, value, f"field {name}")

        return nested
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = [_checker(option) for option in typing.get_args(hint)]

        def union(value: Any, name: str) -> Any:
            for option in options:
                try:
                    return option(value, name)
                except MessageError:
                    continue
            raise MessageError(f"field {name} has the wrong type")

        return union
    if hint is type(None):

        def null(value: Any, name: str) -> Any:
            if value is None:
                return None
            raise MessageError(f"field {name} must be null")

        return null
    if origin is Literal:
        allowed = typing.get_args(hint)

        def literal(value: Any, name: str) -> Any:
            if value in allowed:
                return value
            raise MessageError(f"field {name} is not one of {allowed}")

        return literal
    if origin is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        check_item = _checker(item)

        def sequence(value: Any, name: str) -> Any:
            if not isinstance(value, list) or len(value) > MAX_BLOCKS:
                raise MessageError(f"field {name} must be a list of at most {MAX_BLOCKS}")
            return tuple(check_item(v, name) for v in value)

        return sequence
    expected = (int, float) if hint is float else hint
    label = getattr(hint, "__name__", str(hint))

    def scalar(value: Any, name: str) -> Any:
        if not isinstance(value, expected) or (hint is not bool and isinstance(value, bool)):
            raise MessageError(f"field {name} must be {label}")
        return float(value) if hint is float else value

    return scalar
