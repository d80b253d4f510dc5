"""Which field of a request body makes it too deep or too big to parse, found without parsing
it, so that the 400 that refuses it can name the field (`deep_field`, `busiest_field`).

Both run only on a body already refused, and each is bounded: `deep_field` walks the body's
strings and brackets with one regular expression (C speed; every string is one match) up to the
first place it nests too deeply, at most `MAX_TOKENS` matches; `busiest_field` finds where each
of the fields that can hold many values starts, with one search, and counts the commas between
one and the next with `bytes.count`. They report what the bytes most likely say (a client could
write a decoy key inside a string-free array), which is all a message needs.
"""

from __future__ import annotations

import json
import re

MAX_TOKENS = 200_000
# A JSON string (unrolled: no backtracking), a bracket, or a colon.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:]')
# The fields of a generation request that can hold many values.
_LARGE_FIELDS = (
    "messages", "prompt", "tools", "response_format", "structured_outputs", "logit_bias",
    "stop_token_ids", "chat_template_kwargs",
)  # fmt: skip
_FIELD_AT = re.compile(rb'"(' + b"|".join(f.encode() for f in _LARGE_FIELDS) + rb')"\s*:')


def deep_field(raw: bytes, depth: int, max_keys: int = 3) -> str | None:
    """The dotted path (at most `max_keys` keys, up to the first array) to where `raw` first
    nests more than `depth` levels, or None if it does not (or the walk gives up)."""
    opened_under: list[bytes | None] = []  # per open container: the key it is the value of
    last_string: bytes | None = None
    key: bytes | None = None
    for count, match in enumerate(_TOKEN.finditer(raw)):
        if count > MAX_TOKENS:
            return None
        token = match.group()
        first = token[:1]
        if first == b'"':
            last_string = token
        elif first == b":":
            key, last_string = last_string, None
        elif first in b"[{":
            opened_under.append(key)
            key = None
            if len(opened_under) > depth:
                return _path(opened_under[1:], max_keys)
        else:
            if opened_under:
                opened_under.pop()
            key = None
    return None


def busiest_field(raw: bytes) -> str | None:
    """Of the fields that can hold many values, the one whose bytes hold the most commas, or
    None when the body has none of them."""
    starts: dict[str, int] = {}
    for match in _FIELD_AT.finditer(raw):
        starts.setdefault(match.group(1).decode(), match.start())
        if len(starts) == len(_LARGE_FIELDS):
            break
    if not starts:
        return None
    order = sorted(starts.items(), key=lambda item: item[1])
    ends = [at for _, at in order[1:]] + [len(raw)]
    counts = {name: raw.count(b",", at, end) for (name, at), end in zip(order, ends, strict=True)}
    return max(counts, key=lambda name: counts[name])


def _path(keys: list[bytes | None], max_keys: int) -> str | None:
    names: list[str] = []
    for key in keys[:max_keys]:
        if key is None:
            break
        try:
            name = json.loads(key)
        except ValueError:
            break
        names.append(str(name)[:64])
    return ".".join(names) or None
