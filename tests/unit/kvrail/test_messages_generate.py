"""The request-plane messages: GenerateRequest, TokenEvent (and the RequestOutput it carries),
BlockCounts."""

from __future__ import annotations

import dataclasses
import json
import random
import struct
import typing
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrail.codec import BINARY_MAGIC, WIRE_VERSION, Message, MessageError, decode
from kvrail.keys import PoolKeys
from kvrail.messages import BlockCounts, GenerateRequest, PrefillDone
from kvrail.outputs import (
    MAX_EVENTS_PER_BATCH,
    FirstTokenStages,
    RequestOutput,
    TokenEvent,
    TokenEventBatch,
    TokenLogprobs,
    merged,
)
from kvrail.sampling import SamplingParams


def request(**overrides: Any) -> GenerateRequest:
    base: dict[str, Any] = dict(
        request_id="req-1", token_ids=tuple(range(100, 140)), stream_subject="_INBOX.abc.1",
        deadline_unix_s=1e9, sampling=SamplingParams(max_tokens=16),
    )  # fmt: skip
    base.update(overrides)
    return GenerateRequest(**base)


def event(
    request_id: str, seq: int, token_ids: tuple[int, ...] = (), worker_id: str = "",
    prefill_mode: Any = "", stages: FirstTokenStages | None = None, **output: Any,
) -> TokenEvent:  # fmt: skip
    """A TokenEvent carrying the output of `request_id` with `token_ids` and `output`'s fields."""
    return TokenEvent(
        RequestOutput(request_id, token_ids, **output), seq, worker_id, prefill_mode, stages
    )


def _tamper_output(message: TokenEvent, **changes: Any) -> bytes:
    body = json.loads(message.encode())
    body["output"].update(changes)
    return json.dumps(body).encode()


def _tamper(message: Any, **changes: Any) -> bytes:
    body = json.loads(message.encode())
    body.update(changes)
    return json.dumps(body).encode()


def _tamper_sampling(**changes: Any) -> bytes:
    body = json.loads(request().encode())
    body["sampling"].update(changes)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "message",
    [
        request(),
        request(
            sampling=SamplingParams(
                max_tokens=64,
                temperature=0.7,
                top_p=0.9,
                top_k=40,
                seed=7,
                stop_token_ids=(2, 5),
                ignore_eos=True,
            ),
            tenant_salt="tenant-a",
        ),
        event(
            "r",
            0,
            (5, 6),
            prefill_mode="remote",
            num_cached_tokens=32,
            stages=FirstTokenStages(queue_wait_s=0.01, prefill_compute_s=0.2, copy_s=0.003),
        ),
        event("r", 3, finish_reason="length", stop_reason=2),
        event("r", 1, error="deadline"),
        BlockCounts(
            worker_id="d-0",
            incarnation=9,
            num_blocks=95,
            num_free_blocks=90,
            num_requests=1,
            num_retained=0,
            num_pending=1,
        ),
        PrefillDone(
            request_id="r",
            fingerprint="f",
            dest_incarnation=1,
            block_ids=(1,),
            first_token_id=5,
            num_prompt_tokens=9,
            prefill_worker_id="p-0",
            prefill_incarnation=2,
            queue_wait_s=0.5,
            prefill_compute_s=1.5,
            transfer_queue_s=0.1,
        ),
    ],
)
def test_every_request_plane_message_round_trips(message: Any) -> None:
    assert decode(message.encode(), type(message)) == message


def test_prompt_and_new_tokens_travel_packed() -> None:
    body = json.loads(request(token_ids=tuple(range(5000))).encode())
    assert isinstance(body["token_ids"], str)
    body = json.loads(event("r", 0, (1, 2)).encode())
    assert isinstance(body["output"]["token_ids"], str)


def test_a_prefill_done_without_the_stage_fields_still_decodes() -> None:
    done = PrefillDone(
        request_id="r", fingerprint="f", dest_incarnation=1, block_ids=(1,), first_token_id=5,
        num_prompt_tokens=9, prefill_worker_id="p-0", prefill_incarnation=2,
    )  # fmt: skip
    body = json.loads(done.encode())
    for name in ("queue_wait_s", "prefill_compute_s", "transfer_queue_s"):
        del body[name]
    assert decode(json.dumps(body).encode(), PrefillDone) == done


def test_only_the_last_event_is_last() -> None:
    assert not event("r", 0, (1,)).is_last
    assert event("r", 1, finish_reason="stop").is_last
    assert event("r", 1, error="kv_load_failed").is_last


@pytest.mark.parametrize(
    "data,cls,message",
    [
        (_tamper(request(), request_id=""), GenerateRequest, "request_id"),
        (_tamper(request(), request_id="x" * 129), GenerateRequest, "request_id"),
        (_tamper_sampling(max_tokens=0), GenerateRequest, "max_tokens"),
        (_tamper_sampling(max_tokens="8"), GenerateRequest, "max_tokens must be int"),
        (_tamper(request(), stream_subject="kvrail.*"), GenerateRequest, "stream_subject"),
        (_tamper(request(), stream_subject="a.>"), GenerateRequest, "stream_subject"),
        (_tamper(request(), stream_subject="a b"), GenerateRequest, "stream_subject"),
        (_tamper_sampling(stop_token_ids=[1, -2]), GenerateRequest, "stop_token_ids"),
        (_tamper_sampling(seed=1.5), GenerateRequest, "seed"),
        (_tamper_sampling(ignore_eos=1), GenerateRequest, "ignore_eos"),
        (_tamper(request(), sampling=None), GenerateRequest, "sampling"),
        (_tamper_output(event("r", 0), num_cached_tokens=-1), TokenEvent, "cached"),
        (_tamper(event("r", 0), seq=-1), TokenEvent, "seq"),
        (_tamper(event("r", 0), prefill_mode="guess"), TokenEvent, "prefill"),
        (_tamper_output(event("r", 0), error=7), TokenEvent, "error"),
        (_tamper(event("r", 0), output=None), TokenEvent, "output"),
    ],
)
def test_malformed_request_plane_messages_raise_message_error(
    data: bytes, cls: Any, message: str
) -> None:
    with pytest.raises(MessageError, match=message):
        decode(data, cls)


def test_the_debug_and_refusal_subjects_are_scoped_per_worker() -> None:
    keys = PoolKeys("team-a", "llama")
    assert keys.debug("d-0") == "kvrail.team-a.llama.debug.d-0"
    assert keys.prefill_refused("d-0") == "kvrail.team-a.llama.refused.d-0"
    with pytest.raises(ValueError, match="worker id"):
        keys.debug("d.*")


def test_a_steps_events_travel_as_one_batch_and_a_bad_batch_is_refused() -> None:
    events = tuple(event(f"r-{i}", 3, (i,), worker_id="d-0") for i in range(50)) + (
        event("r-0", 4, finish_reason="length", worker_id="d-0"),
    )
    batch = TokenEventBatch(events)
    assert decode(batch.encode(), TokenEventBatch) == batch
    body = json.loads(Message.encode(batch))  # the JSON form, which decoding still accepts
    assert decode(json.dumps(body).encode(), TokenEventBatch) == batch
    for events_field, message in (([], "1 to"), ({}, "list"), ([{"seq": 1}], "lacks field")):
        body["events"] = events_field
        with pytest.raises(MessageError, match=message):
            decode(json.dumps(body).encode(), TokenEventBatch)


_ids = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
_outputs = st.builds(
    RequestOutput,
    request_id=_ids,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=20).map(tuple),
    finish_reason=st.sampled_from([None, "stop", "length", "abort"]),
    stop_reason=st.none() | st.integers(0, 2**31),
    error=st.sampled_from([None, "deadline", "worker_lost"]),
    num_cached_tokens=st.integers(0, 10**6),
)
_events = st.builds(
    TokenEvent,
    output=_outputs,
    seq=st.integers(0, 2**32 - 1),
    worker_id=_ids,
    prefill_mode=st.sampled_from(["", "local", "remote", "recompute"]),
    stages=st.none() | st.builds(FirstTokenStages, queue_wait_s=st.floats(0, 10)),
)


@given(st.lists(_events, min_size=1, max_size=8))
def test_the_binary_batch_carries_every_field_of_every_event(events: list[TokenEvent]) -> None:
    batch = TokenEventBatch(tuple(events))
    data = batch.encode()
    assert data.startswith(BINARY_MAGIC)
    assert decode(data, TokenEventBatch) == batch == decode(Message.encode(batch), TokenEventBatch)


def test_a_damaged_binary_batch_raises_message_error_and_nothing_else() -> None:
    first = event("r-0", 0, (5, 6), worker_id="d-0", prefill_mode="local",
                  stages=FirstTokenStages(copy_s=0.25))  # fmt: skip
    data = TokenEventBatch((first, event("r-1", 3, (7,), "d-0", finish_reason="length"))).encode()
    for cut in range(len(data)):  # every truncation
        with pytest.raises(MessageError):
            decode(data[:cut], TokenEventBatch)
    rng = random.Random(7)
    for _ in range(2000):  # random damage: refused, or (a byte of an id or a token) another batch
        damaged = bytearray(data)
        damaged[rng.randrange(len(BINARY_MAGIC), len(data))] = rng.randrange(256)
        try:
            decode(bytes(damaged), TokenEventBatch)
        except MessageError:
            pass
    head = len(BINARY_MAGIC)

    def with_rest(rest: bytes) -> bytes:
        event_head = struct.pack("<HHIII", 1, 1, 0, 0, len(rest))
        return BINARY_MAGIC + struct.pack("<BI", WIRE_VERSION, 1) + event_head + b"rw" + rest

    hostile = {
        "version": data[:head] + bytes([WIRE_VERSION + 1]) + data[head + 1 :],
        "no events": BINARY_MAGIC + struct.pack("<BI", WIRE_VERSION, 0),
        "too many": BINARY_MAGIC + struct.pack("<BI", WIRE_VERSION, MAX_EVENTS_PER_BATCH + 1),
        "trailing bytes": data + b"x",
        "unknown field": with_rest(b'{"bogus": 1}'),
        "wrong type": with_rest(b'{"num_cached_tokens": "many"}'),
        "refused value": with_rest(b'{"num_cached_tokens": -1}'),
        "not an object": with_rest(b"[1]"),
        "not JSON": with_rest(b"{"),
    }
    for name, bad in hostile.items():
        with pytest.raises(MessageError):
            decode(bad, TokenEventBatch)
        assert with_rest(b"") != bad, name
    assert decode(with_rest(b""), TokenEventBatch).events[0].request_id == "r"
    with pytest.raises(MessageError, match="2\\*\\*32"):
        TokenEventBatch((event("r", 0, (2**32,), worker_id="d"),)).encode()


def _non_default(hint: Any) -> Any:
    """A value of type `hint` (a field's annotation) other than the field's default."""
    kinds = {typing.get_origin(hint)} | set(typing.get_args(hint)) | {hint}
    if TokenLogprobs in kinds:
        return (TokenLogprobs(1, -0.5, (1, 9), (-0.5, -2.25)),)
    if tuple in kinds:
        return (3, 4)
    if str in kinds:
        return "x"
    if int in kinds:
        return 7
    if float in kinds:
        return 0.5
    if FirstTokenStages in kinds:
        return FirstTokenStages(copy_s=0.5)
    return "remote"  # the prefill mode's literal


@pytest.mark.parametrize(
    "cls,name",
    [(RequestOutput, f.name) for f in dataclasses.fields(RequestOutput)]
    + [(TokenEvent, f.name) for f in dataclasses.fields(TokenEvent) if f.name != "output"],
)
def test_every_field_of_the_record_and_its_event_travels_in_the_binary_batch(
    cls: Any, name: str
) -> None:
    """Derived from the types: a field added to `RequestOutput` (or `TokenEvent`) is carried by
    the binary form with no change to its codec."""
    hint = typing.get_type_hints(cls)[name]
    value = _non_default(hint)
    output = RequestOutput("r", (1,))
    if cls is RequestOutput:
        output = dataclasses.replace(output, **{name: value})
        one = TokenEvent(output, 0, "d-0")
    else:
        one = dataclasses.replace(TokenEvent(output, 0, "d-0"), **{name: value})
    data = TokenEventBatch((one,)).encode()
    assert decode(data, TokenEventBatch).events == (one,)


def test_merged_outputs_concatenate_tokens_and_keep_the_latest_of_the_rest() -> None:
    first = RequestOutput("r", (1, 2), num_cached_tokens=16)
    middle = RequestOutput("r", (3,))
    last = RequestOutput("r", (4,), finish_reason="stop", stop_reason=4)
    assert merged([first]) is first
    assert merged([first, middle, last]) == RequestOutput(
        "r", (1, 2, 3, 4), finish_reason="stop", stop_reason=4, num_cached_tokens=16
    )
