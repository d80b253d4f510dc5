from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrail.errors import ConfigError, KvrailError
from kvrail.router.policy import (
    POLICIES,
    Candidate,
    Chooser,
    Decision,
    NoWorkerError,
    Policy,
    WeightedScorer,
    holding_peer,
)


def cand(worker_id: str, matched: int = 0, running: int = 0, waiting: int = 0,
         in_flight: int = 0, util: float = 0.0) -> Candidate:  # fmt: skip
    return Candidate(worker_id, matched, running, waiting, in_flight, util)


def test_the_policies_are_the_crd_router_policies() -> None:
    assert set(POLICIES) == {"kv-aware", "least-loaded", "round-robin"}


@pytest.mark.parametrize("policy", POLICIES)
def test_no_candidate_raises_no_worker_error(policy: Policy) -> None:
    with pytest.raises(NoWorkerError):
        Chooser(policy).choose([], num_prompt_blocks=4)
    assert issubclass(NoWorkerError, KvrailError)


def test_an_unknown_policy_or_a_negative_weight_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="random"):
        Chooser("random")
    with pytest.raises(ConfigError):
        Chooser("kv-aware", scorers=[WeightedScorer("load", -1)])


def test_kv_aware_prefers_a_long_cached_prefix_over_a_slightly_busier_worker() -> None:
    # 2k-token prompt (128 blocks of 16): the cached worker runs 3 more requests.
    cached = cand("cached", matched=128, running=3)
    idle = cand("idle")
    decision = Chooser("kv-aware").choose([idle, cached], num_prompt_blocks=128)
    assert decision == Decision("cached", "kv-aware", 128, 3 * 32.0)


def test_kv_aware_avoids_a_worker_with_a_big_queue_despite_its_cache() -> None:
    busy = cand("busy", matched=128, running=4, waiting=6)
    idle = cand("idle")
    decision = Chooser("kv-aware").choose([busy, idle], num_prompt_blocks=128)
    assert decision.worker_id == "idle"
    assert decision.matched_blocks == 0
    assert decision.score == 128


def test_the_routers_own_in_flight_counts_before_etcd_reports_them() -> None:
    # etcd still says both are idle; this router just sent 5 requests to "a".
    a, b = cand("a", in_flight=5), cand("b")
    assert Chooser("kv-aware").choose([a, b], 10).worker_id == "b"
    assert Chooser("least-loaded").choose([a, b], 10).worker_id == "b"
    # Once etcd reports them, they are not counted twice.
    assert cand("a", running=5, in_flight=5).load == 5


def test_kv_utilization_breaks_a_tie_towards_free_blocks_and_bad_reports_do_not_win() -> None:
    full, free = cand("full", util=0.95), cand("free", util=0.1)
    assert Chooser("kv-aware").choose([full, free], 8).worker_id == "free"
    for bad in (float("nan"), -1.0, 7.0):
        liar = cand("liar", util=bad)
        assert Chooser("kv-aware").choose([liar, cand("ok", util=0.5)], 8).worker_id == "ok"


def test_matched_blocks_beyond_the_prompt_are_not_a_negative_cost() -> None:
    chooser = Chooser("kv-aware")
    assert chooser.cost(cand("a", matched=10), num_prompt_blocks=4) == 0.0


def test_ties_are_broken_at_random_and_reproducibly_with_a_seed() -> None:
    workers = [cand(f"w{i}") for i in range(4)]
    picks = [Chooser("kv-aware", random.Random(7)).choose(workers, 4).worker_id for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same pick
    chooser = Chooser("least-loaded", random.Random(1))
    counts = Counter(chooser.choose(workers, 4).worker_id for _ in range(400))
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert min(counts.values()) > 50


def test_round_robin_continues_after_the_last_pick_when_the_pool_changes() -> None:
    chooser = Chooser("round-robin")
    pool = [cand("c"), cand("a"), cand("b")]
    assert [chooser.choose(pool, 0).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    # "b" leaves and "bb" joins: the rotation goes on after "a", not from the start.
    pool = [cand("a"), cand("bb"), cand("c")]
    assert [chooser.choose(pool, 0).worker_id for _ in range(3)] == ["bb", "c", "a"]
    decision = chooser.choose([cand("z", matched=3)], 5)
    assert decision == Decision("z", "round-robin", 3, 0.0)


# Properties --------------------------------------------------------------------------------------
_ids = st.lists(st.sampled_from([f"w{i}" for i in range(8)]), min_size=1, max_size=8, unique=True)


@st.composite
def candidates(draw: Any) -> list[Candidate]:
    return [
        cand(
            worker_id,
            matched=draw(st.integers(0, 64)),
            running=draw(st.integers(0, 20)),
            waiting=draw(st.integers(0, 20)),
            in_flight=draw(st.integers(0, 40)),
            util=draw(st.floats(0.0, 1.0)),
        )
        for worker_id in draw(_ids)
    ]


@settings(max_examples=200, deadline=None)
@given(cs=candidates(), policy=st.sampled_from(POLICIES), blocks=st.integers(0, 64),
       seed=st.integers(0, 2**32))  # fmt: skip
def test_the_chosen_worker_is_always_a_candidate(
    cs: list[Candidate], policy: Policy, blocks: int, seed: int
) -> None:
    decision = Chooser(policy, random.Random(seed)).choose(cs, blocks)
    chosen = next(c for c in cs if c.worker_id == decision.worker_id)
    assert decision.matched_blocks == chosen.matched_blocks
    assert decision.policy == policy


@settings(max_examples=200, deadline=None)
@given(ids=_ids, matches=st.lists(st.integers(0, 64), min_size=8, max_size=8),
       load=st.integers(0, 10), util=st.floats(0.0, 1.0), seed=st.integers(0, 2**32))  # fmt: skip
def test_kv_aware_with_equal_load_picks_a_worker_with_the_most_matched_blocks(
    ids: list[str], matches: list[int], load: int, util: float, seed: int
) -> None:
    cs = [cand(w, matched=m, running=load, util=util) for w, m in zip(ids, matches, strict=False)]
    decision = Chooser("kv-aware", random.Random(seed)).choose(cs, num_prompt_blocks=64)
    assert decision.matched_blocks == max(c.matched_blocks for c in cs)


_loads = st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(0, 40))


@settings(max_examples=200, deadline=None)
@given(
    ids=_ids,
    loads=st.lists(_loads, min_size=8, max_size=8),
    matched=st.integers(0, 64),
    policy=st.sampled_from(["kv-aware", "least-loaded"]),
    seed=st.integers(0, 2**32),
)
def test_with_equal_matches_a_least_loaded_worker_is_picked(
    ids: list[str],
    loads: list[tuple[int, int, int]],
    matched: int,
    policy: Policy,
    seed: int,
) -> None:
    cs = [cand(w, matched, r, q, f, util=0.5) for w, (r, q, f) in zip(ids, loads, strict=False)]
    decision = Chooser(policy, random.Random(seed)).choose(cs, num_prompt_blocks=64)
    chosen = next(c for c in cs if c.worker_id == decision.worker_id)
    assert chosen.load == min(c.load for c in cs)


@settings(max_examples=100, deadline=None)
@given(cs=candidates(), rounds=st.integers(1, 3), order_seed=st.integers(0, 2**32))
def test_round_robin_visits_each_of_n_stable_candidates_once_per_n_calls(
    cs: list[Candidate], rounds: int, order_seed: int
) -> None:
    chooser = Chooser("round-robin")
    shuffled = list(cs)
    for _ in range(rounds):
        random.Random(order_seed).shuffle(shuffled)  # the caller's order does not matter
        picks = [chooser.choose(shuffled, 8).worker_id for _ in range(len(cs))]
        assert sorted(picks) == sorted(c.worker_id for c in cs)


@pytest.mark.parametrize(
    ("reported", "at_report", "ours", "load"),
    [
        (1, 1, 0, 0),  # our request ended after the report: it stops counting at once
        (0, 0, 3, 3),  # a burst we just sent counts before any report has it
        (5, 2, 1, 4),  # the others' 3 as of the report, plus our 1 now
        (1, 3, 2, 2),  # a report older than some of ours never counts less than ours
    ],
)
def test_load_is_the_others_requests_at_the_report_plus_ours_now(
    reported: int, at_report: int, ours: int, load: int
) -> None:
    candidate = Candidate("w", 0, reported, 0, ours, 0.0, in_flight_at_report=at_report)
    assert candidate.load == load
    assert cand("w", running=reported, in_flight=ours).load == max(reported, ours)  # unknown


def test_kv_aware_keeps_a_repeated_prompt_where_it_is_cached_once_our_request_ended() -> None:
    """The worker's record still counts the request that just ended on it (it refreshes about
    every second); this router knows it ended, and the 2 cached blocks win."""
    cached = Candidate("cached", 2, 1, 0, 0, 0.0, in_flight_at_report=1)
    other = Candidate("other", 0, 0, 0, 0, 0.0, in_flight_at_report=0)
    assert Chooser("kv-aware").choose([other, cached], num_prompt_blocks=3).worker_id == "cached"
    stale = Candidate("cached", 2, 1, 0, 0, 0.0)  # without what the report counted of ours
    assert Chooser("kv-aware").choose([other, stale], num_prompt_blocks=3).worker_id == "other"


def test_a_holding_peer_is_named_only_when_its_blocks_save_more_than_it_would_compute() -> None:
    peers = [cand("a", matched=7, running=3), cand("b", matched=7, running=1), cand("c", 2)]
    assert holding_peer(peers, held_blocks=2, num_prompt_blocks=10) == peers[1]  # least loaded
    assert holding_peer(peers, held_blocks=4, num_prompt_blocks=10) == peers[1]  # saves 3, adds 3
    assert holding_peer(peers, held_blocks=5, num_prompt_blocks=10) is None  # saves 2, computes 3
    assert holding_peer(peers, held_blocks=3, num_prompt_blocks=10) == peers[1]  # saves 4
    assert holding_peer(peers, held_blocks=7, num_prompt_blocks=7) is None  # holds no more
    assert holding_peer([], held_blocks=0, num_prompt_blocks=10) is None


@given(
    matched=st.lists(st.integers(0, 40), max_size=6),
    held=st.integers(0, 40),
    extra=st.integers(0, 40),
)
def test_a_holding_peer_always_saves_at_least_what_it_computes(
    matched: list[int], held: int, extra: int
) -> None:
    num_blocks = max([held, *matched]) + extra
    peers = [cand(f"w{i}", matched=m) for i, m in enumerate(matched)]
    peer = holding_peer(peers, held, num_blocks)
    if peer is None:
        return
    assert peer.matched_blocks == max(matched) > held
    assert num_blocks - peer.matched_blocks <= peer.matched_blocks - held


@given(candidates(), st.integers(0, 16), st.integers(1, 5), st.integers(0, 1000))
@settings(max_examples=200, deadline=None)
def test_ranked_leads_with_choose_s_decision_then_the_cheapest_others(
    pool: list[Candidate], num_blocks: int, n: int, seed: int
) -> None:
    chosen = Chooser("kv-aware", random.Random(seed)).choose(pool, num_blocks)
    ranker = Chooser("kv-aware", random.Random(seed))
    ranked = ranker.ranked(pool, num_blocks, n)
    assert ranked[0] == chosen
    ids = [d.worker_id for d in ranked]
    assert len(ids) == len(set(ids)) == min(n, len(pool))
    costs = [d.score for d in ranked[1:]]
    assert costs == sorted(costs) and all(c >= chosen.score for c in costs)
    left_out = [ranker.cost(c, num_blocks) for c in pool if c.worker_id not in ids]
    assert all(c >= max([chosen.score, *costs]) - 1e-9 for c in left_out)


def test_ranked_round_robin_follows_the_rotation() -> None:
    chooser = Chooser("round-robin")
    pool = [cand("c"), cand("a"), cand("b")]
    assert [d.worker_id for d in chooser.ranked(pool, 1, 3)] == ["a", "b", "c"]
    assert [d.worker_id for d in chooser.ranked(pool, 1, 2)] == ["b", "c"]
    assert chooser.choose(pool, 1).worker_id == "c"
