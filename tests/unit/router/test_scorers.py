"""Routing scorers: pure costs under weights; kv-aware and least-loaded are profiles of them."""

from __future__ import annotations

import random
import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrail.crd.spec import ScorerName
from kvrail.errors import ConfigError
from kvrail.router.__main__ import chooser
from kvrail.router.policy import (
    DISK_BLOCK_COST,
    HOST_BLOCK_COST,
    PROFILES,
    SCORERS,
    Candidate,
    Chooser,
    WeightedScorer,
    kv_utilization_cost,
    load_cost,
    prefix_cache_cost,
)
from kvrail.settings import load_settings


def cand(worker_id: str = "w", matched: int = 0, running: int = 0, in_flight: int = 0,
         util: float = 0.0) -> Candidate:  # fmt: skip
    return Candidate(worker_id, matched, running, 0, in_flight, util)


def test_every_scorer_the_api_names_exists_and_no_other() -> None:
    assert set(SCORERS) == set(typing.get_args(ScorerName))


@pytest.mark.parametrize(
    ("candidate", "blocks", "prefix", "load", "utilization"),
    [
        (cand(matched=3, running=2, util=0.25), 10, 7.0, 2.0, 0.25),
        (cand(matched=12, in_flight=4), 10, 0.0, 4.0, 0.0),  # more cached than asked: 0
        (cand(util=float("nan")), 0, 0.0, 0.0, 1.0),  # a bad report counts as full
        (cand(util=1.5), 0, 0.0, 0.0, 1.0),
    ],
)
def test_each_scorer_is_one_cost_of_the_candidate(
    candidate: Candidate, blocks: int, prefix: float, load: float, utilization: float
) -> None:
    assert prefix_cache_cost(candidate, blocks) == prefix
    assert load_cost(candidate, blocks) == load
    assert kv_utilization_cost(candidate, blocks) == utilization


_candidate = st.builds(
    Candidate, st.sampled_from(["a", "b", "c"]), st.integers(0, 64), st.integers(0, 20),
    st.integers(0, 20), st.integers(0, 40),
    st.one_of(st.floats(0.0, 1.0), st.just(float("nan")), st.floats(-2.0, 3.0)),
    st.one_of(st.none(), st.integers(0, 40)),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(candidate=_candidate, blocks=st.integers(0, 64))
def test_the_kv_aware_profile_costs_exactly_the_former_formula(
    candidate: Candidate, blocks: int
) -> None:
    utilization = candidate.kv_utilization
    if not 0.0 <= utilization <= 1.0:
        utilization = 1.0
    former = max(blocks - candidate.matched_blocks, 0) + 32.0 * candidate.load + 16.0 * utilization
    assert Chooser("kv-aware").cost(candidate, blocks) == former
    assert Chooser("least-loaded").cost(candidate, blocks) == float(candidate.load)


def test_the_default_profiles_are_kv_aware_and_least_loaded() -> None:
    assert {k: [(w.name, w.weight) for w in v] for k, v in PROFILES.items()} == {
        "kv-aware": [("prefix-cache", 1.0), ("load", 32.0), ("kv-utilization", 16.0)],
        "least-loaded": [("load", 1.0)],
    }


def test_own_weights_replace_the_kv_aware_profile() -> None:
    cached_busy, idle = cand("cached", matched=8, running=1), cand("idle")
    assert Chooser("kv-aware").choose([cached_busy, idle], 8).worker_id == "idle"
    prefix_first = [WeightedScorer("prefix-cache", 1), WeightedScorer("load", 4)]
    chooser = Chooser("kv-aware", random.Random(3), scorers=prefix_first)
    decision = chooser.choose([cached_busy, idle], 8)
    assert (decision.worker_id, decision.policy, decision.score) == ("cached", "kv-aware", 4.0)
    load_only = Chooser("kv-aware", scorers=[WeightedScorer("load", 1)])
    assert load_only.choose([cand("a", matched=8, running=1), idle], 8).worker_id == "idle"


@pytest.mark.parametrize(
    ("policy", "scorers", "message"),
    [
        ("kv-aware", [WeightedScorer("queue", 1)], "queue"),
        ("kv-aware", [WeightedScorer("load", 1), WeightedScorer("load", 2)], "twice"),
        ("kv-aware", [WeightedScorer("load", -1)], ">= 0"),
        ("kv-aware", [WeightedScorer("load", float("nan"))], ">= 0"),
        ("kv-aware", [WeightedScorer("load", 0)], "above 0"),
        ("kv-aware", [], "above 0"),
        ("least-loaded", [WeightedScorer("load", 1)], "kv-aware"),
        ("round-robin", [WeightedScorer("load", 1)], "kv-aware"),
    ],
)
def test_an_invalid_profile_is_a_config_error(
    policy: Any, scorers: list[WeightedScorer], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Chooser(policy, scorers=scorers)


def test_the_router_process_builds_its_chooser_from_settings() -> None:
    default = chooser(load_settings(environ={}))
    assert (default.policy, default.profile) == ("kv-aware", PROFILES["kv-aware"])
    own = chooser(load_settings(environ={"KVRAIL_ROUTER_SCORERS": "load=2"}))
    assert own.profile == (WeightedScorer("load", 2),)
    with pytest.raises(ConfigError, match="kv-aware"):
        chooser(load_settings(environ={"KVRAIL_ROUTER_POLICY": "round-robin",
                                       "KVRAIL_ROUTER_SCORERS": "load=2"}))  # fmt: skip


# -- KV tiers: a lower-tier hit is cheaper than computing the block, dearer than a GPU hit ------


def tiered(
    worker_id: str, matched: int, host: int = 0, disk: int = 0, running: int = 0
) -> Candidate:
    return Candidate(worker_id, matched, running, 0, 0, 0.0, num_host_blocks=host,
                     num_disk_blocks=disk)  # fmt: skip


def test_a_lower_tier_block_costs_a_fraction_of_computing_it_the_disk_more_than_the_host() -> None:
    assert 0.1 <= HOST_BLOCK_COST <= 0.25 and 0.3 <= DISK_BLOCK_COST <= 0.5
    gpu, host, disk, miss = (
        prefix_cache_cost(c, 10)
        for c in (tiered("g", 10), tiered("h", 10, host=10), tiered("d", 10, disk=10),
                  tiered("m", 0))
    )  # fmt: skip
    assert gpu == 0.0 < host == 10 * HOST_BLOCK_COST < disk == 10 * DISK_BLOCK_COST < miss == 10
    mixed = tiered("x", 6, host=2, disk=1)  # 3 GPU blocks, 2 host, 1 disk, 4 to compute
    assert prefix_cache_cost(mixed, 10) == pytest.approx(4 + 2 * HOST_BLOCK_COST + DISK_BLOCK_COST)


@pytest.mark.parametrize(
    ("candidate", "blocks", "expected"),
    [
        (tiered("a", 12, host=12), 10, 10 * HOST_BLOCK_COST),  # more matched than asked
        (tiered("a", 4, host=9), 10, 6 + 4 * HOST_BLOCK_COST),  # counts beyond the match
        (tiered("a", 4, host=3, disk=3), 10, 6 + 3 * HOST_BLOCK_COST + DISK_BLOCK_COST),
        (tiered("a", 4, host=-2, disk=-1), 10, 6.0),  # a negative count is none
    ],
)
def test_lower_tier_counts_are_clipped_to_the_match(
    candidate: Candidate, blocks: int, expected: float
) -> None:
    assert prefix_cache_cost(candidate, blocks) == pytest.approx(expected)


def test_kv_aware_weighs_a_host_held_prefix_between_a_gpu_hit_and_recomputation() -> None:
    """A 2k-token prompt (128 blocks): the worker holding its prefix in host memory wins over
    one that would compute it and has up to three fewer requests, and loses to a GPU hit on a
    worker as busy."""
    chooser = Chooser("kv-aware", random.Random(1))
    cold = tiered("cold", 0, running=1)
    for running, winner in ((4, "host"), (5, "cold")):
        host_held = tiered("host", 128, host=128, running=running)
        assert chooser.choose([host_held, cold], 128).worker_id == winner
    host_held = tiered("host", 128, host=128, running=1)
    assert chooser.choose([host_held, tiered("gpu", 128, running=1)], 128).worker_id == "gpu"
    disk_held = tiered("disk", 128, disk=128, running=1)
    assert chooser.choose([host_held, disk_held], 128).worker_id == "host"
    decision = chooser.choose([disk_held, cold], 128)
    assert (decision.worker_id, decision.matched_blocks) == ("disk", 128)
