"""The KV index per tier: events of each tier, states with lower tiers, and prefix matching that
counts each block in its fastest tier."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrail.messages import KV_TIERS, KvEvent, KvTier, KvTierState
from kvrail.router.discovery.index import KvIndex, PrefixMatch


def ev(
    seq: int,
    tier: KvTier = "gpu",
    stored: tuple[str, ...] = (),
    removed: tuple[str, ...] = (),
    *,
    worker_id: str = "d-0",
    cleared: bool = False,
) -> KvEvent:
    return KvEvent(worker_id=worker_id, incarnation=1, seq=seq, stored=stored, removed=removed,
                   cleared=cleared, tier=tier)  # fmt: skip


def state(
    worker_id: str = "d-0",
    seq: int = 0,
    gpu: tuple[str, ...] = (),
    host: tuple[str, ...] = (),
    disk: tuple[str, ...] = (),
) -> KvEvent:
    lower = tuple(KvTierState(t, h) for t, h in (("host", host), ("disk", disk)) if h)
    return KvEvent(worker_id=worker_id, incarnation=1, seq=seq, stored=gpu, cleared=True,
                   lower_tiers=lower)  # fmt: skip


def test_a_state_loads_every_tier_and_events_change_only_their_own() -> None:
    index = KvIndex()
    index.load_state(state(seq=3, gpu=("a",), host=("a", "b"), disk=("c",)))
    assert [index.num_hashes("d-0", t) for t in KV_TIERS] == [1, 2, 1]
    assert index.num_hashes("d-0") == 4
    assert index.apply(ev(4, "host", removed=("a",)))  # the host evicted a: the GPU keeps it
    assert index.apply(ev(5, "disk", stored=("a",)))
    assert index.apply(ev(6, "gpu", removed=("a",)))
    assert index.match_tiers(["a", "b", "c"]) == {"d-0": PrefixMatch(3, 1, 2)}
    assert index.apply(ev(7, "disk", cleared=True))  # a cleared event clears its tier alone
    assert index.match_tiers(["a"]) == {}
    assert index.match_tiers(["b"]) == {"d-0": PrefixMatch(1, 1, 0)}
    assert index.last_seq("d-0") == 7


def test_one_seq_sequence_spans_the_tiers_and_a_gap_in_any_tier_is_refused() -> None:
    index = KvIndex()
    index.load_state(state(seq=1))
    assert index.apply(ev(2, "host", stored=("a",)))
    assert index.apply(ev(2, "gpu", stored=("x",)))  # a duplicate seq, whatever its tier
    assert index.apply(ev(4, "gpu", stored=("b",))) is False  # seq 3 (of any tier) was lost
    assert index.num_hashes("d-0", "gpu") == 0 and index.num_hashes("d-0", "host") == 1


def test_the_gpu_run_then_the_lower_tiers_run_count_up_to_a_block_in_neither() -> None:
    index = KvIndex()
    prompt = ["h0", "h1", "h2", "h3", "h4"]
    index.load_state(state("gpu-only", gpu=("h0", "h1", "h2")))
    index.load_state(
        state("mixed", gpu=("h0", "h3"), host=("h0", "h1", "h3"), disk=("h1", "h2", "h4"))
    )
    index.load_state(state("host-first", host=("h0",), gpu=("h1", "h2")))
    index.load_state(state("gap", gpu=("h0", "h2"), disk=("h3",)))
    index.load_state(state("late", disk=("h1", "h2")))  # no first block: nothing usable
    assert index.match_tiers(prompt) == {
        "gpu-only": PrefixMatch(3),
        # h0 in GPU (also host); then h1 host (also disk), h2 disk, h3 host (also GPU: loaded,
        # as the engine does after its GPU run), h4 disk
        "mixed": PrefixMatch(5, 2, 2),
        "host-first": PrefixMatch(1, 1, 0),  # h1 is in GPU memory only: the engine stops there
        "gap": PrefixMatch(1),
    }
    assert index.match_tiers(prompt)["mixed"].num_gpu_blocks == 1
    assert index.match_all(prompt) == {"gpu-only": 3, "mixed": 5, "host-first": 1, "gap": 1}
    assert index.matched_blocks("late", prompt) == 0
    assert [index.matched_blocks(w, prompt) for w in ("mixed", "host-first", "gap")] == [5, 1, 1]


def test_forget_drops_every_tier_of_the_worker_at_once() -> None:
    index = KvIndex()
    index.load_state(state("a", gpu=("h0",), host=("h1",), disk=("h2",)))
    index.load_state(state("b", host=("h0",)))
    index.forget("a")
    assert index.workers() == {"b"}
    assert index.match_tiers(["h0", "h1", "h2"]) == {"b": PrefixMatch(1, 1, 0)}
    assert index.match_tiers(["h1"]) == index.match_tiers(["h2"]) == {}  # a's host and disk
    index.forget("b")
    assert index.match_tiers(["h0"]) == {} and index._holders == {t: {} for t in KV_TIERS}


def test_the_cap_counts_a_worker_s_hashes_over_every_tier() -> None:
    index = KvIndex(max_hashes_per_worker=3)
    index.load_state(state(gpu=("a", "b"), host=("a", "c"), disk=("d",)))
    assert index.num_hashes("d-0") == 3 and index.num_dropped_hashes == 2


def test_a_live_event_cannot_carry_lower_tiers_and_a_state_must_be_of_the_gpu() -> None:
    with pytest.raises(ValueError, match="lower_tiers"):
        KvEvent("d-0", 1, 1, lower_tiers=(KvTierState("host", ("a",)),))
    with pytest.raises(ValueError, match="lower_tiers"):
        KvEvent("d-0", 1, 1, cleared=True, lower_tiers=(KvTierState("gpu", ("a",)),))
    with pytest.raises(ValueError, match="lower_tiers"):
        KvEvent("d-0", 1, 1, cleared=True, lower_tiers=(KvTierState("host"),) * 2)
    with pytest.raises(ValueError, match="tier gpu"):
        KvIndex().load_state(KvEvent("d-0", 1, 1, cleared=True, tier="host"))


# A model of the index with tiers: per worker and tier a plain set; a prompt's match is the
# leading run in GPU memory, then the run in host memory or on disk (the host first).
_hash = st.sampled_from([f"h{i}" for i in range(6)])
_worker = st.sampled_from(["a", "b", "c"])
_tier = st.sampled_from(KV_TIERS)
_op = st.tuples(
    st.sampled_from(["load", "store", "remove", "forget"]), _worker, _tier,
    st.lists(_hash, max_size=4),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=30), prompt=st.lists(_hash, max_size=6))
def test_match_tiers_agrees_with_a_set_model(
    ops: list[tuple[str, str, KvTier, list[str]]], prompt: list[str]
) -> None:
    index = KvIndex()
    model: dict[str, dict[KvTier, set[str]]] = {}
    seqs: dict[str, int] = {}
    for kind, worker_id, tier, hashes in ops:
        if kind == "load":
            loaded = {t: set(hashes) if t == tier else set(hashes[:1]) for t in KV_TIERS}
            index.load_state(state(worker_id, 0, *(tuple(sorted(loaded[t])) for t in KV_TIERS)))
            model[worker_id], seqs[worker_id] = loaded, 0
        elif kind == "forget":
            index.forget(worker_id)
            model.pop(worker_id, None)
        elif worker_id in model:
            seqs[worker_id] += 1
            stored = tuple(hashes) if kind == "store" else ()
            removed = tuple(hashes) if kind == "remove" else ()
            assert index.apply(ev(seqs[worker_id], tier, stored, removed, worker_id=worker_id))
            model[worker_id][tier] = (model[worker_id][tier] - set(removed)) | set(stored)
    expected: dict[str, PrefixMatch] = {}
    for worker_id, tiers in model.items():
        counts = dict.fromkeys(KV_TIERS, 0)
        usable: tuple[KvTier, ...] = KV_TIERS
        for h in prompt:
            fastest = next((t for t in usable if h in tiers[t]), None)
            if fastest is None:
                break
            counts[fastest] += 1
            usable = usable if fastest == "gpu" else ("host", "disk")
        if sum(counts.values()):
            expected[worker_id] = PrefixMatch(sum(counts.values()), counts["host"], counts["disk"])
        for tier in KV_TIERS:
            assert index.num_hashes(worker_id, tier) == len(tiers[tier])
    assert index.match_tiers(prompt) == expected
    assert index.match_all(prompt) == {w: m.num_blocks for w, m in expected.items()}
    for worker_id in model:
        assert index.matched_blocks(worker_id, prompt) == index.match_all(prompt).get(worker_id, 0)
