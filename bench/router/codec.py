"""What one token event costs to encode (decode worker) and decode (router), against the way
`kvrail.messages` did it before (`dataclasses.asdict` per encode, `typing.get_type_hints` per
decode), both measured in this run on the same message.

    .venv/bin/python -P bench/router/codec.py | tee bench/router/codec.txt

A decode worker encodes one `TokenEvent` per running request per engine step, and a router
decodes one per token it streams, so at 2,000 tokens/s these are paid 2,000 times a second.
"""

from __future__ import annotations

import json
import platform
import time
import typing
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import Any

from kvrail.codec import WIRE_VERSION, decode
from kvrail.messages import _PACKED, TokenEvent, _pack

REPEATS = 5
N = 20_000


def per_call_us(fn: Callable[[], Any]) -> float:
    """The best of REPEATS runs of N calls, in microseconds per call."""
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(N):
            fn()
        best = min(best, (time.perf_counter() - start) / N)
    return best * 1e6


def main() -> None:
    event = TokenEvent("chatcmpl-" + "0" * 32, 7, (12345,), None, None, "decode-0")
    data = event.encode()
    assert decode(data, TokenEvent) == event

    def old_encode() -> bytes:  # the former Message.encode, line for line
        body: dict[str, Any] = {"v": WIRE_VERSION, "kind": event.kind}
        for name, value in asdict(event).items():
            if name in _PACKED:
                body[name] = _pack(tuple(value), _PACKED[name][0])
            else:
                body[name] = list(value) if isinstance(value, tuple) else value
        return json.dumps(body, separators=(",", ":")).encode()

    def old_decode() -> TokenEvent:  # today's decode plus the lookups the former one made per call
        typing.get_type_hints(TokenEvent)
        fields(TokenEvent)
        return decode(data, TokenEvent)

    assert old_encode() == data

    rows = [
        ("encode", per_call_us(event.encode), per_call_us(old_encode)),
        ("decode", per_call_us(lambda: decode(data, TokenEvent)), per_call_us(old_decode)),
    ]
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"best of {REPEATS} x {N:,} calls, one TokenEvent of {len(data)} bytes")  # fmt: skip
    print(f"{'':8}{'now us':>10}{'before us':>12}")
    for name, now, before in rows:
        print(f"{name:8}{now:10.1f}{before:12.1f}")


if __name__ == "__main__":
    main()
