"""KV events of the lower tiers: one seq sequence over every tier, a mirror per tier, and a
kvstate reply that carries each tier within the message limits."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kvrail.codec import MessageError, decode
from kvrail.hashing import block_hashes, root_hash
from kvrail.messages import KV_TIERS, KvEvent, KvTier, KvTierState
from kvrail.router.discovery.index import KvIndex, PrefixMatch
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.roles.kv_event_log import KvEventLog
from kvrail.worker.testing import make_engine, tiny_llama_config


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def hx(*ids: int) -> tuple[str, ...]:
    return tuple(h(i).hex() for i in ids)


class TieredRouter:
    """A router's view of one worker per tier, fed as the contract says: state, then events."""

    def __init__(self, state: KvEvent) -> None:
        state = decode(state.encode(), KvEvent)  # as it travels
        assert state.cleared and state.tier == "gpu" and not state.removed
        self.cached: dict[KvTier, set[str]] = {t: set() for t in KV_TIERS}
        self.cached["gpu"] = set(state.stored)
        for lower in state.lower_tiers:
            self.cached[lower.tier] = set(lower.stored)
        self.seq = state.seq

    def apply(self, event: KvEvent) -> None:
        event = decode(event.encode(), KvEvent)
        if event.seq <= self.seq:
            return
        assert event.seq == self.seq + 1, f"gap: {self.seq} -> {event.seq}"
        held = self.cached[event.tier]
        assert not set(event.stored) & held and set(event.removed) <= held
        held.difference_update(event.removed)
        held.update(event.stored)
        self.seq = event.seq


def test_each_tier_s_changes_are_events_of_that_tier_in_one_seq_sequence() -> None:
    log = KvEventLog("d-0", 2, max_event_blocks=2)
    events = log.events_for(KvChanges(stored=(h(1), h(2))))
    events += log.events_for(KvChanges(stored=(h(1), h(2), h(3)), tier="host"))  # split in two
    events += log.events_for(KvChanges(stored=(h(2),), tier="disk"))
    events += log.events_for(KvChanges(removed=(h(2),), tier="host"))
    assert [(e.seq, e.tier) for e in events] == [
        (1, "gpu"), (2, "host"), (3, "host"), (4, "disk"), (5, "host"),
    ]  # fmt: skip
    assert events[1].stored == hx(1, 2) and events[2].stored == hx(3)
    assert {t: list(c) for t, c in log.cached.items()} == {
        "gpu": list(hx(1, 2)), "host": list(hx(1, 3)), "disk": list(hx(2)),
    }  # fmt: skip


def test_the_state_carries_the_gpu_in_stored_and_each_lower_tier_holding_any() -> None:
    log = KvEventLog("d-0", 2)
    assert log.state() == KvEvent("d-0", 2, 0, cleared=True)  # no tier: as before the tiers
    log.events_for(KvChanges(stored=(h(1),)))
    log.events_for(KvChanges(stored=(h(1), h(2)), tier="host"))
    state = log.state()
    assert state.stored == hx(1) and state.seq == 2
    assert state.lower_tiers == (KvTierState("host", hx(1, 2)),)  # the empty disk tier is left out
    log.events_for(KvChanges(stored=(h(3),), tier="disk"))
    log.events_for(KvChanges(removed=(h(1), h(2)), tier="host"))
    assert log.state().lower_tiers == (KvTierState("disk", hx(3)),)
    assert decode(log.state().encode(), KvEvent) == log.state()


def test_a_state_over_the_limit_keeps_the_faster_tiers_first_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = KvEventLog("d-0", 1, max_state_blocks=5)
    log.events_for(KvChanges(stored=(h(1), h(2), h(3))))
    log.events_for(KvChanges(stored=(h(4), h(5), h(6)), tier="host"))
    log.events_for(KvChanges(stored=(h(7),), tier="disk"))
    with caplog.at_level(logging.WARNING, logger="kvrail.worker.roles.kv_events"):
        state = log.state()
    assert state.stored == hx(1, 2, 3)
    assert state.lower_tiers == (KvTierState("host", hx(4, 5)), KvTierState("disk", ()))
    assert "kv state truncated" in caplog.text and "cached_blocks=7" in caplog.text


def test_a_router_that_fetches_the_state_mid_stream_converges_in_every_tier() -> None:
    log = KvEventLog("d-0", 1)
    published = log.events_for(KvChanges(stored=(h(1), h(2))))
    published += log.events_for(KvChanges(stored=(h(1),), tier="host"))
    state = log.state()  # the router asks here; seqs 1-2 are in flight
    published += log.events_for(KvChanges(removed=(h(1),)))  # GPU eviction: the host keeps it
    published += log.events_for(KvChanges(stored=(h(1),), tier="disk"))
    published += log.events_for(KvChanges(removed=(h(1),), tier="host"))
    router = TieredRouter(state)
    for event in published:
        router.apply(event)
    assert router.cached == {t: set(c) for t, c in log.cached.items()}
    assert router.cached == {"gpu": set(hx(2)), "host": set(), "disk": set(hx(1))}


def test_a_kv_event_without_a_tier_decodes_as_gpu_and_an_unknown_tier_is_refused() -> None:
    old = {"v": 1, "kind": "kv_event", "worker_id": "d-0", "incarnation": 1, "seq": 3,
           "stored": list(hx(1))}  # fmt: skip
    body = json.loads(KvEvent("d-0", 1, 3).encode())
    old["v"] = body["v"]  # the current wire version
    event = decode(json.dumps(old).encode(), KvEvent)
    assert (event.tier, event.lower_tiers, event.stored) == ("gpu", (), hx(1))
    with pytest.raises(MessageError, match="tier"):
        decode(json.dumps({**old, "tier": "ssd"}).encode(), KvEvent)
    with pytest.raises(MessageError, match="lower_tiers"):  # only a cleared state carries tiers
        decode(json.dumps({**old, "lower_tiers": [{"tier": "host"}]}).encode(), KvEvent)
    host = KvEvent("d-0", 1, 4, stored=hx(2), removed=hx(1), tier="host")
    assert decode(host.encode(), KvEvent) == host


# -- a real (tiny) engine with a host and a disk tier ------------------------------------------

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
BLOCK_SIZE = 4
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 8 * 4  # layers x (K, V) x tokens x KV heads x dim x fp32


def test_events_mirror_every_tier_of_an_engine_and_predict_its_hits(tmp_path: Path) -> None:
    """Sessions whose prefixes outgrow the GPU pool, on an engine with tiers: after each turn the
    log's mirror and a router fed by its events hold exactly each tier's hashes, and the
    router's index counts as many usable prompt blocks for the next turn as the engine uses."""
    with torch.device("cpu"):
        engine = make_engine(tiny_llama_config(), seed=3, max_model_len=60, num_blocks=16,
                             block_size=BLOCK_SIZE, kv_host_tier_bytes=12 * BLOCK_BYTES,
                             kv_disk_tier_path=str(tmp_path),
                             kv_disk_tier_bytes=400 * BLOCK_BYTES)  # fmt: skip
    log = KvEventLog("d-0", 1, max_event_blocks=5)
    router = TieredRouter(log.state())
    index = KvIndex()
    index.load_state(log.state())
    root = root_hash(engine.fingerprint.digest)
    prompts = [[5 + s, 6 + s, 7 + s] for s in range(3)]
    num_lower_hits = 0
    for turn in range(4):
        for s, prompt in enumerate(prompts):
            prompt.extend((11 * s + 7 * turn + i) % 90 + 3 for i in range(13))
            hashes = [h.hex() for h in block_hashes(prompt, BLOCK_SIZE, root)]
            match = index.match_tiers(hashes).get("d-0", PrefixMatch(0))
            request = engine.add_request(f"s{s}t{turn}", list(prompt), PARAMS)
            while engine.has_unfinished_requests():
                engine.step()
            # What the router predicted is what the engine used (the last prompt token is
            # always computed, so a fully cached prompt uses one block fewer).
            assert request.num_cached_tokens // BLOCK_SIZE == min(
                match.num_blocks, (len(prompt) - 1) // BLOCK_SIZE
            )
            num_lower_hits += match.num_host_blocks + match.num_disk_blocks
            for changes in (engine.take_kv_events(), *engine.take_tier_events()):
                for event in log.events_for(changes):
                    router.apply(event)
                    assert index.apply(decode(event.encode(), KvEvent))
            for tier in KV_TIERS:
                held = {h.hex() for h in engine.tier_block_hashes(tier)}
                assert set(log.cached[tier]) == router.cached[tier] == held, tier
    engine.close()
    assert num_lower_hits > 0  # the sessions were served from the lower tiers
    assert log.cached["disk"]  # and the host tier overflowed to disk
    late = TieredRouter(log.state())  # a router starting now sees the same through the state
    assert late.cached == router.cached
