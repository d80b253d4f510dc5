"""KV events of the lower tiers: one seq sequence over every tier, a mirror per tier, and a
kvstate reply that carries each tier within the message limits."""

from __future__ import annotations

import json
import logging

import pytest

from kvrail.codec import MessageError, decode
from kvrail.messages import KV_TIERS, KvEvent, KvTier, KvTierState
from kvrail.worker.engine.block_pool import KvChanges
from kvrail.worker.roles.kv_event_log import KvEventLog


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
