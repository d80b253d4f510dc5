"""What a token event costs to encode (decode worker) and decode (router): one event alone, and
one event of a 256-event `TokenEventBatch` (a decode worker's step at 256 running requests).

    .venv/bin/python -P bench/studies/router/codec.py | tee bench/studies/router/codec.txt

A decode worker encodes every running request's event each engine step and a router decodes
one per token it streams: at 20,000 streamed tokens/s these are paid 20,000 times a second.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

from kvrail.codec import Message, decode
from kvrail.outputs import RequestOutput, TokenEvent, TokenEventBatch

REPEATS = 5
N = 20_000


def per_call_us(fn: Callable[[], Any], n: int = N) -> float:
    """The best of REPEATS runs of `n` calls, in microseconds per call."""
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def main() -> None:
    event = TokenEvent(RequestOutput("chatcmpl-" + "0" * 32, (12345,)), 7, "decode-0")
    data = event.encode()
    assert decode(data, TokenEvent) == event
    batch = TokenEventBatch(
        tuple(TokenEvent(RequestOutput(f"chatcmpl-{i:032d}", (12345,)), 7, "decode-0")
              for i in range(256))
    )  # fmt: skip
    batch_data = batch.encode()  # the batch's binary form
    json_data = Message.encode(batch)  # the JSON form every other message has
    assert decode(batch_data, TokenEventBatch) == batch == decode(json_data, TokenEventBatch)
    single = TokenEventBatch((event,))
    single_data, single_json = single.encode(), Message.encode(single)
    rows = [
        ("encode one", per_call_us(event.encode)),
        ("decode one", per_call_us(lambda: decode(data, TokenEvent))),
        ("batch of 1, encode, binary", per_call_us(single.encode)),
        ("batch of 1, encode, JSON", per_call_us(lambda: Message.encode(single))),
        ("batch of 1, decode, binary", per_call_us(lambda: decode(single_data, TokenEventBatch))),
        ("batch of 1, decode, JSON", per_call_us(lambda: decode(single_json, TokenEventBatch))),
        ("per event of 256, encode, binary", per_call_us(batch.encode, N // 256) / 256),
        ("per event of 256, encode, JSON",
         per_call_us(lambda: Message.encode(batch), N // 256) / 256),
        ("per event of 256, decode, binary",
         per_call_us(lambda: decode(batch_data, TokenEventBatch), N // 256) / 256),
        ("per event of 256, decode, JSON",
         per_call_us(lambda: decode(json_data, TokenEventBatch), N // 256) / 256),
    ]  # fmt: skip
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"best of {REPEATS} runs; one TokenEvent of {len(data)} bytes, a batch of 256 of "
          f"{len(batch_data)} bytes (binary) or {len(json_data)} (JSON)")  # fmt: skip
    for name, us in rows:
        print(f"{name:34}{us:8.1f} us")


if __name__ == "__main__":
    main()
