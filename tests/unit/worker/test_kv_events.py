"""KV events: seq numbering, splitting, the kvstate mirror, and a router's view of a real engine."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrail.codec import MAX_BLOCKS, MAX_MESSAGE_BYTES, decode
from kvrail.hashing import block_hashes, root_hash
from kvrail.messages import KvEvent
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.roles.kv_event_log import MAX_STATE_BLOCKS, KvEventLog, block_limits
from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Router:
    """A router's index of one worker, fed the way the contract says: state, then events."""

    def __init__(self) -> None:
        self.cached: set[str] = set()
        self.seq = 0

    def apply_state(self, state: KvEvent) -> None:
        assert state.cleared and not state.removed
        self.cached = set(state.stored)
        self.seq = state.seq

    def apply(self, event: KvEvent) -> None:
        event = decode(event.encode(), KvEvent)  # as it travels
        if event.seq <= self.seq:
            return  # already in the state
        assert event.seq == self.seq + 1, f"gap: {self.seq} -> {event.seq}"
        assert not event.cleared
        assert not set(event.stored) & set(event.removed)
        assert not set(event.stored) & self.cached, "stored twice"
        assert set(event.removed) <= self.cached, "removed before stored"
        self.cached.difference_update(event.removed)
        self.cached.update(event.stored)
        self.seq = event.seq


def test_seqs_start_at_one_and_grow_by_one_per_event() -> None:
    log = KvEventLog("decode-0", 7)
    first = log.events_for(KvChanges(stored=(h(1), h(2))))
    assert log.events_for(KvChanges()) == []  # nothing changed: no event, no seq
    second = log.events_for(KvChanges(stored=(h(3),), removed=(h(1),)))
    assert [e.seq for e in first + second] == [1, 2]
    assert first[0] == KvEvent("decode-0", 7, 1, stored=(h(1).hex(), h(2).hex()))
    assert second[0].stored == (h(3).hex(),) and second[0].removed == (h(1).hex(),)
    assert list(log.cached["gpu"]) == [h(2).hex(), h(3).hex()]


def test_a_batch_over_the_limit_is_split_into_events_with_consecutive_seqs() -> None:
    log = KvEventLog("w", 1, max_event_blocks=3)
    log.events_for(KvChanges(stored=(h(100), h(101))))
    stored = tuple(h(i) for i in range(7))
    events = log.events_for(KvChanges(stored=stored, removed=(h(100), h(101))))
    assert [e.seq for e in events] == [2, 3, 4]
    assert [len(e.stored) for e in events] == [3, 3, 1]
    assert [len(e.removed) for e in events] == [2, 0, 0]
    assert tuple(x for e in events for x in e.stored) == tuple(x.hex() for x in stored)
    assert set(log.cached["gpu"]) == {x.hex() for x in stored}


def test_a_batch_of_more_than_max_blocks_hashes_splits_into_messages_that_decode() -> None:
    log = KvEventLog("w", 1)
    stored = tuple(h(i) for i in range(MAX_BLOCKS + 5))
    removed = tuple(h(10**9 + i) for i in range(MAX_BLOCKS))
    log.cached["gpu"].update((x.hex(), None) for x in removed)
    events = log.events_for(KvChanges(stored=stored, removed=removed))
    assert [(e.seq, len(e.stored), len(e.removed)) for e in events] == [
        (1, MAX_BLOCKS, MAX_BLOCKS),
        (2, 5, 0),
    ]
    for event in events:
        assert decode(event.encode(), KvEvent) == event  # within the wire limits


def test_the_state_is_every_cached_hash_at_the_last_seq() -> None:
    log = KvEventLog("w", 3)
    assert log.state() == KvEvent("w", 3, 0, cleared=True)  # before any event
    log.events_for(KvChanges(stored=(h(1), h(2), h(3))))
    log.events_for(KvChanges(removed=(h(2),)))
    state = log.state()
    assert state.seq == 2 and state.cleared and state.removed == ()
    assert state.stored == (h(1).hex(), h(3).hex())


def test_a_state_over_the_limit_holds_the_first_hashes_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = KvEventLog("w", 1, max_state_blocks=2)
    log.events_for(KvChanges(stored=(h(1), h(2), h(3))))
    with caplog.at_level(logging.WARNING, logger="kvrail.worker.roles.kv_events"):
        state = log.state()
    assert state.stored == (h(1).hex(), h(2).hex()) and state.seq == 1
    assert "kv state truncated" in caplog.text and "cached_blocks=3" in caplog.text


def test_a_router_that_fetches_the_state_mid_stream_converges() -> None:
    log = KvEventLog("w", 1)
    published = log.events_for(KvChanges(stored=(h(1), h(2))))
    published += log.events_for(KvChanges(stored=(h(3),)))
    state = log.state()  # the router asks here; seqs 1-2 are in flight
    published += log.events_for(KvChanges(stored=(h(4),), removed=(h(1),)))
    router = Router()
    router.apply_state(state)
    for event in published:  # it receives every event, in order, and skips the old ones
        router.apply(event)
    assert router.cached == set(log.cached["gpu"]) == {h(i).hex() for i in (2, 3, 4)}


def test_block_limits_must_be_within_one_and_max_blocks() -> None:
    with pytest.raises(ValueError, match="block limits"):
        KvEventLog("w", 1, max_event_blocks=0)
    with pytest.raises(ValueError, match="block limits"):
        KvEventLog("w", 1, max_event_blocks=MAX_BLOCKS + 1)
    with pytest.raises(ValueError, match="block limits"):
        KvEventLog("w", 1, max_state_blocks=MAX_STATE_BLOCKS + 1)
    with pytest.raises(ValueError, match="no KV event"):
        block_limits(512)


@pytest.mark.parametrize("max_payload", [1024 * 1024, 2 * 1024 * 1024, MAX_MESSAGE_BYTES])
def test_events_and_states_at_the_block_limits_fit_the_max_payload(max_payload: int) -> None:
    event_blocks, state_blocks = block_limits(max_payload)
    log = KvEventLog(
        "w" * 63, time.time_ns(), max_event_blocks=event_blocks, max_state_blocks=state_blocks
    )
    log.seq = 10**18
    for k, tier in enumerate(("gpu", "host", "disk")):  # every tier full past the reply's room
        log.cached[tier].update((h(10**9 * (k + 1) + i).hex(), None) for i in range(state_blocks))
    removed = tuple(h(10**9 + i) for i in range(event_blocks + 1))
    stored = tuple(h(i) for i in range(event_blocks + 1))
    events = log.events_for(KvChanges(stored=stored, removed=removed))
    assert [len(e.stored) for e in events] == [event_blocks, 1]
    for message in [*events, log.state()]:
        assert len(message.encode()) <= max_payload
        assert decode(message.encode(), KvEvent) == message
    state = log.state()
    lists = [state.stored, *(t.stored for t in state.lower_tiers)]
    assert sum(map(len, lists)) == state_blocks and max(map(len, lists)) <= MAX_BLOCKS
    assert len(state.stored) == min(state_blocks, MAX_BLOCKS)  # the GPU's first
    if max_payload == MAX_MESSAGE_BYTES:  # a full list per tier
        assert event_blocks == MAX_BLOCKS and state_blocks == MAX_STATE_BLOCKS == 3 * MAX_BLOCKS
    elif max_payload == 1024 * 1024:  # the NATS default: ~15k hashes per list, ~30k per state
        assert 14_000 < event_blocks < 15_000 and 29_000 < state_blocks < 30_000


# -- a real (tiny) engine ----------------------------------------------------------------------

BLOCK_SIZE = 4
PREFIXES = [[11 + (7 * i + j) % 80 for j in range(12)] for i in range(3)]  # 3 blocks each


def tiny_engine(**overrides: Any) -> Any:
    overrides.setdefault("num_blocks", 20)
    return make_engine(tiny_llama_config(), seed=5, block_size=BLOCK_SIZE, **overrides)


def full_block_hex(engine: Any, prompt: list[int]) -> set[str]:
    root = root_hash(engine.fingerprint.digest)
    return {x.hex() for x in block_hashes(prompt, BLOCK_SIZE, root)}


def test_a_computed_prompt_is_stored_and_an_installed_remote_prompt_only_at_install() -> None:
    engine = tiny_engine()
    log = KvEventLog("w", 1)
    prompt = PREFIXES[0] + [5, 6]  # 14 tokens: 3 full blocks
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    events = log.events_for(engine.take_kv_events())
    assert {x for e in events for x in e.stored} == full_block_hex(engine, prompt)
    remote = PREFIXES[1] + [7, 8, 9, 10, 12]  # 17 tokens: 4 full blocks
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    assert engine.reserve_remote("remote", remote, params) is not None
    assert engine.take_kv_events().stored == ()  # reserved blocks hold no KV yet
    engine.install_remote("remote", 42)
    assert {x.hex() for x in engine.take_kv_events().stored} == full_block_hex(engine, remote)
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_empty(engine)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "remote", "install", "step", "step", "abort", "reset"]),
        st.integers(0, 2),  # which shared prefix
        st.integers(0, 9),  # tail length / choice
    ),
    min_size=10,
    max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_a_router_fed_by_the_events_mirrors_the_engine_cache_after_a_random_workload(
    ops: list[tuple[str, int, int]],
) -> None:
    """Local prefills, remote installs, decodes that fill blocks, aborts, evictions and resets:
    after every batch of events the router's index equals the engine's prefix cache."""
    engine = tiny_engine(num_blocks=12)  # 11 usable: evictions are frequent
    log = KvEventLog("w", 1, max_event_blocks=3)  # small: splitting happens too
    router = Router()
    router.apply_state(log.state())
    reserved: list[str] = []
    for i, (op, prefix, n) in enumerate(ops):
        prompt = PREFIXES[prefix][: 4 + n] + [(13 * i + k) % 80 + 11 for k in range(n % 5)]
        params = SamplingParams(max_tokens=1 + n, ignore_eos=True)
        if op == "add":
            engine.add_request(f"r{i}", prompt, params)
        elif op == "remote":
            if engine.reserve_remote(f"r{i}", prompt, params) is not None:
                reserved.append(f"r{i}")
        elif op == "install" and reserved:
            engine.install_remote(reserved.pop(n % len(reserved)), 50)
        elif op == "step":
            for _ in range(n + 1):
                engine.step()
        elif op == "abort" and engine.scheduler.requests:
            victim = sorted(engine.scheduler.requests)[n % len(engine.scheduler.requests)]
            engine.abort(victim)
            if victim in reserved:
                reserved.remove(victim)
        elif op == "reset":
            engine.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
        if n % 3 == 0:  # some batches span several operations
            for event in log.events_for(engine.take_kv_events()):
                router.apply(event)
            assert router.cached == {x.hex() for x in engine.cached_block_hashes()}
    for request_id in reserved:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    for event in log.events_for(engine.take_kv_events()):
        router.apply(event)
    cached = {x.hex() for x in engine.cached_block_hashes()}
    assert router.cached == cached == set(log.cached["gpu"])
    late = Router()  # a router that starts now sees the same through the state
    late.apply_state(decode(log.state().encode(), KvEvent))
    assert late.cached == router.cached and late.seq == log.seq
    assert_engine_empty(engine)
