"""The router's work per streamed token and per response, each way it was done, in one process:
CPU time per call.

    taskset -c 1 .venv/bin/python -P bench/studies/router/token_path.py   # output: token_path.txt

Pairs, each timed in the same run: a step's 12 one-token events decoded (per event) against
building each with `TokenEvent(...)`; one event built slot by slot (`EventLayout._plain`) against
the dataclasses' `__init__`; a chat response's chunks (role, six text chunks, finish, usage) from
the templates against the text chunk's template made per response and the others built and
serialized in full, as before (with today's `_event`, whose encoder is built once); a labelled
metric child looked up once against `labels()` on every call; compact JSON with one encoder
against `json.dumps`.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from kvrail.binary_codec import _BATCH_HEAD, _EVENT_HEAD
from kvrail.outputs import _LAYOUT, RequestOutput, TokenEvent, TokenEventBatch
from kvrail.router.api import streaming
from kvrail.router.metrics import RouterMetrics

sys.path.insert(0, str(Path(__file__).parent))
from request_parts import per_call_us

EVENTS = tuple(
    TokenEvent(RequestOutput(f"chatcmpl-{i:032x}", (28_120,)), 5, "stub-0") for i in range(12)
)
BATCH = TokenEventBatch(EVENTS).encode()
NAME = "SmolLM2-135M-Instruct"


def events_built_in_full() -> list[TokenEvent]:
    """What `decode_binary` did before building events slot by slot: each through `__init__`."""
    at, events = _BATCH_HEAD.size, []
    for _ in range(12):
        rid_len, wid_len, seq, num_tokens, _rest = _EVENT_HEAD.unpack_from(BATCH, at)
        at += _EVENT_HEAD.size
        tokens_at = at + rid_len + wid_len
        tokens = struct.unpack_from(f"<{num_tokens}I", BATCH, tokens_at)
        output = RequestOutput(BATCH[at : at + rid_len].decode(), tokens)
        events.append(TokenEvent(output, seq, BATCH[at + rid_len : tokens_at].decode()))
        at = tokens_at + 4 * num_tokens
    return events


def fresh_reply() -> streaming.Reply:
    return streaming.Reply("chat", "chatcmpl-" + "a" * 32, NAME, 1_733_000_000, 20, True)


LAST = streaming.Piece(" hello", "length", 16)


def chunks_from_templates() -> None:
    reply = fresh_reply()
    reply.role_event()
    for _ in range(6):
        reply.text_event(" hello")
    reply.finish_event("length")
    reply.usage_event(reply.usage(LAST))


def chunks_before_templates() -> None:
    """As the router wrote them before (fa5ada6): the text chunk from a template made per
    response, the others built and serialized in full."""
    reply, event = fresh_reply(), streaming._event
    event(reply.chunk("", None, first=True))
    mark = "\u0000kvrail-text\u0000"
    head, tail = event(reply.chunk(mark, None)).decode().split(json.dumps(mark), 1)
    head_bytes, tail_bytes = head.encode(), tail.encode()
    for _ in range(6):
        head_bytes + json.dumps(" hello").encode() + tail_bytes
    event(reply.chunk(None, "length"))
    event(reply.chunk(None, None, usage=reply.usage(LAST)))


def main() -> int:
    assert events_built_in_full() == list(TokenEventBatch.decode_binary(BATCH).events)
    metrics = RouterMetrics()
    labels = metrics.requests.labels
    uncached = labels.__wrapped__  # type: ignore[attr-defined]
    usage = fresh_reply().usage(LAST)
    pairs = {
        "a step's events decoded, per event": (
            lambda: TokenEventBatch.decode_binary(BATCH), lambda: events_built_in_full(), 12,
        ),
        "one event": (
            lambda: _LAYOUT._plain("chatcmpl-x", 5, (1,), "stub-0"),
            lambda: TokenEvent(RequestOutput("chatcmpl-x", (1,)), 5, "stub-0"), 1,
        ),
        "a chat response's 9 chunks": (chunks_from_templates, chunks_before_templates, 1),
        "a labelled metric child": (lambda: labels("chat", "200"),
                                    lambda: uncached("chat", "200"), 1),
        "the usage object as compact JSON": (
            lambda: streaming.compact_json(usage),
            lambda: json.dumps(usage, separators=(",", ":")), 1,
        ),
    }  # fmt: skip
    print("# CPU per call, us: now | before")
    for name, (now, before, per) in pairs.items():
        now_us, before_us = per_call_us(now, 20_000) / per, per_call_us(before, 20_000) / per
        print(f"{name:40s} {now_us:7.2f} | {before_us:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
