"""The binary form of the one message a router decodes per token it streams, the
`TokenEventBatch`: part of the wire codec (`kvrail.codec` is the JSON form every message has).
"""

from __future__ import annotations

import json
import struct
import sys
import typing
from array import array
from collections.abc import Callable, Sequence
from dataclasses import MISSING, fields
from typing import Any

from kvrail.codec import (
    BINARY_MAGIC,
    MAX_MESSAGE_BYTES,
    MAX_TOKENS,
    WIRE_VERSION,
    MessageError,
    compact_json,
    encode_value,
    field_checkers,
)


class EventLayout:
    """The binary form of a batch of token events, derived from the event type and its record
    (`kvrail.messages.TokenEvent` and `RequestOutput`): a router decodes one entry per token it
    streams, several times faster than JSON (`bench/studies/router/codec.py`).

    `BINARY_MAGIC`, the wire version (u8) and the number of events (u32), then per event a
    header of five little-endian fields (u16 length of the request id, u16 length of the worker
    id, u32 seq, u32 number of tokens, u32 length of the rest), the two ids in UTF-8, the token
    ids as u32, and "the rest": empty, or a JSON object of every other field of the event and of
    its record whose value is not its default (most events have none; the first and the last
    do), written and checked as the JSON codec writes and checks them. Which fields those are
    comes from the two dataclasses, so a field added to either travels with no change here; it
    needs a default and a name the other type does not use.
    """

    def __init__(self, event_cls: type[Any], record_cls: type[Any]) -> None:
        hints = typing.get_type_hints(event_cls)
        (record_field,) = (name for name, hint in hints.items() if hint is record_cls)
        header = {record_field, "seq", "worker_id", "request_id", "token_ids"}
        self._event_cls, self._record_cls, self._record_field = event_cls, record_cls, record_field
        self._event_rest = _rest_defaults(event_cls, header)
        self._record_rest = _rest_defaults(record_cls, header)
        if self._event_rest.keys() & self._record_rest.keys():
            raise TypeError(f"{event_cls.__name__} and {record_cls.__name__} share a field name")
        self._checkers = {**field_checkers(event_cls), **field_checkers(record_cls)}
        self._plain = _plain_builder(event_cls, record_cls, record_field, self._event_rest,
                                     self._record_rest)  # fmt: skip

    def encode(self, events: Sequence[Any]) -> bytes:
        parts = [_BATCH_HEAD.pack(BINARY_MAGIC, WIRE_VERSION, len(events))]
        for event in events:
            record = getattr(event, self._record_field)
            rid, wid = record.request_id.encode(), event.worker_id.encode()
            rest = _rest(event, self._event_rest, _rest(record, self._record_rest, {}))
            raw = compact_json(rest).encode() if rest else b""
            try:
                tokens = array("I", record.token_ids)
            except OverflowError as err:
                raise MessageError("a token id is negative or above 2**32 - 1") from err
            if not _LITTLE_ENDIAN:
                tokens.byteswap()
            if len(rid) > _MAX_ID_BYTES or len(wid) > _MAX_ID_BYTES:
                raise MessageError(f"an id is longer than {_MAX_ID_BYTES} bytes")
            head = _EVENT_HEAD.pack(len(rid), len(wid), event.seq, len(tokens), len(raw))
            parts += (head, rid, wid, tokens.tobytes(), raw)
        data = b"".join(parts)
        if len(data) > MAX_MESSAGE_BYTES:
            raise MessageError(f"token event batch of {len(data)} bytes exceeds the limit")
        return data

    def decode(self, data: bytes, max_events: int) -> tuple[Any, ...]:
        """The events `encode` wrote; raises MessageError for anything else."""
        try:
            _magic, version, count = _BATCH_HEAD.unpack_from(data, 0)
            if version != WIRE_VERSION:
                raise MessageError(f"unsupported wire version (want {WIRE_VERSION})")
            if not 0 < count <= max_events:
                raise MessageError(f"a batch holds 1 to {max_events} events")
            at, end = _BATCH_HEAD.size, len(data)
            events = []
            head, head_size = _EVENT_HEAD.unpack_from, _EVENT_HEAD.size
            for _ in range(count):
                rid_len, wid_len, seq, num_tokens, rest_len = head(data, at)
                at += head_size
                tokens_at = at + rid_len + wid_len
                rest_at = tokens_at + 4 * num_tokens
                after = rest_at + rest_len
                if after > end or num_tokens > MAX_TOKENS:
                    raise MessageError("token event batch is truncated")
                tokens = struct.unpack_from(f"<{num_tokens}I", data, tokens_at)
                request_id = data[at : at + rid_len].decode()
                worker_id = data[at + rid_len : tokens_at].decode()
                if rest_len:  # the first or the last event: every field checked
                    event = self._checked(request_id, seq, tokens, worker_id, data[rest_at:after])
                else:
                    event = self._plain(request_id, seq, tokens, worker_id)
                events.append(event)
                at = after
            if at != end:
                raise MessageError("token event batch has bytes after its last event")
            return tuple(events)
        except (struct.error, UnicodeDecodeError, TypeError, ValueError) as err:
            raise MessageError(f"invalid token event batch: {type(err).__name__}") from err

    def _checked(
        self, request_id: str, seq: int, token_ids: tuple[int, ...], worker_id: str, raw: bytes
    ) -> Any:
        try:
            rest = json.loads(raw)
        except ValueError as err:
            raise MessageError("a token event's fields are not valid JSON") from err
        if not isinstance(rest, dict) or not rest.keys() <= self._checkers.keys():
            raise MessageError("a token event's fields are not an object of known fields")
        checked = {name: self._checkers[name](value, name) for name, value in rest.items()}
        record = self._record_cls(
            request_id=request_id, token_ids=token_ids,
            **{k: v for k, v in checked.items() if k in self._record_rest},
        )  # fmt: skip
        return self._event_cls(
            seq=seq, worker_id=worker_id, **{self._record_field: record},
            **{k: v for k, v in checked.items() if k in self._event_rest},
        )  # fmt: skip


_BATCH_HEAD = struct.Struct(f"<{len(BINARY_MAGIC)}sBI")
_EVENT_HEAD = struct.Struct("<HHIII")
_MAX_ID_BYTES = 65_535
_LITTLE_ENDIAN = sys.byteorder == "little"


def _rest_defaults(cls: type[Any], header: set[str]) -> dict[str, Any]:
    """The fields of `cls` outside the header, with their defaults (each must have one)."""
    rest = {f.name: f.default for f in fields(cls) if f.name not in header}
    if MISSING in rest.values():
        raise TypeError(f"every field of {cls.__name__} a batch's rest carries needs a default")
    return rest


def _rest(obj: Any, defaults: dict[str, Any], into: dict[str, Any]) -> dict[str, Any]:
    for name, default in defaults.items():
        value = getattr(obj, name)
        if value != default:
            into[name] = encode_value(value)
    return into


def _plain_builder(
    event_cls: type[Any],
    record_cls: type[Any],
    record_field: str,
    event_rest: dict[str, Any],
    record_rest: dict[str, Any],
) -> Callable[[str, int, tuple[int, ...], str], Any]:
    """A function that builds an event whose rest is all defaults, its slots set directly: a
    frozen dataclass's `__init__` sets each field through `object.__setattr__`, then runs
    `__post_init__`, and a router decodes one event per streamed token. The function is written
    out for the two types (as `dataclasses` writes `__init__`): one call per slot, no loop, so
    the two objects cost about what one did before the record had its own type. What the
    `__post_init__`s check holds already: `seq` was a u32, the defaults are valid."""
    scope: dict[str, Any] = {"new": object.__new__, "E": event_cls, "R": record_cls}
    lines = ["def plain(request_id, seq, token_ids, worker_id):", " r = new(R)", " e = new(E)"]

    def put(obj: str, cls: type[Any], name: str, value: str) -> None:
        setter = f"set_{obj}_{name}"
        scope[setter] = cls.__dict__[name].__set__
        lines.append(f" {setter}({obj}, {value})")

    put("r", record_cls, "request_id", "request_id")
    put("r", record_cls, "token_ids", "token_ids")
    for name, default in record_rest.items():
        scope[f"r_{name}"] = default
        put("r", record_cls, name, f"r_{name}")
    put("e", event_cls, record_field, "r")
    put("e", event_cls, "seq", "seq")
    put("e", event_cls, "worker_id", "worker_id")
    for name, default in event_rest.items():
        scope[f"e_{name}"] = default
        put("e", event_cls, name, f"e_{name}")
    lines.append(" return e")
    exec("\n".join(lines), scope)
    plain: Callable[[str, int, tuple[int, ...], str], Any] = scope["plain"]
    return plain
