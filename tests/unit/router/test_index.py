from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrail.hashing import block_hashes, root_hash
from kvrail.messages import KvEvent
from kvrail.router.discovery.index import KvIndex, prompt_hashes


def ev(
    worker_id: str = "d-0",
    seq: int = 1,
    stored: tuple[str, ...] = (),
    removed: tuple[str, ...] = (),
    *,
    incarnation: int = 1,
    cleared: bool = False,
) -> KvEvent:
    return KvEvent(worker_id=worker_id, incarnation=incarnation, seq=seq, stored=stored,
                   removed=removed, cleared=cleared)  # fmt: skip


def state(
    worker_id: str = "d-0", seq: int = 0, stored: tuple[str, ...] = (), *, incarnation: int = 1
) -> KvEvent:
    return ev(worker_id, seq, stored, incarnation=incarnation, cleared=True)


def test_an_event_for_a_worker_without_loaded_state_is_refused_and_applies_nothing() -> None:
    index = KvIndex()
    assert index.apply(ev(stored=("a",))) is False
    assert index.workers() == set()
    assert index.match_all(["a"]) == {}


def test_events_in_sequence_apply_and_duplicates_are_ignored() -> None:
    index = KvIndex()
    index.load_state(state(seq=4, stored=("a", "b")))
    assert index.apply(ev(seq=5, stored=("c",), removed=("a",)))
    assert index.apply(ev(seq=5, stored=("x",)))  # a duplicate delivery: ignored
    assert index.apply(ev(seq=3, removed=("b",)))  # older than the state: covered by it
    assert index.num_hashes("d-0") == 2
    assert index.matched_blocks("d-0", ["b", "c"]) == 2
    assert index.matched_blocks("d-0", ["x"]) == 0
    assert index.last_seq("d-0") == 5


def test_a_gap_is_refused_without_partial_effect() -> None:
    index = KvIndex()
    index.load_state(state(seq=1, stored=("a",)))
    assert index.apply(ev(seq=3, stored=("b",), removed=("a",))) is False
    assert index.matched_blocks("d-0", ["a"]) == 1
    assert index.match_all(["b"]) == {}
    assert index.last_seq("d-0") == 1


def test_a_newer_incarnation_forgets_the_stale_state_and_asks_for_a_fetch() -> None:
    index = KvIndex()
    index.load_state(state(seq=7, stored=("a",)))
    assert index.apply(ev(seq=1, stored=("b",), incarnation=2)) is False
    assert index.workers() == set()
    assert index.match_all(["a"]) == {}
    index.load_state(state(seq=1, stored=("b",), incarnation=2))
    assert index.incarnation("d-0") == 2
    assert index.match_all(["b"]) == {"d-0": 1}


def test_an_older_incarnation_is_refused_and_keeps_the_current_state() -> None:
    index = KvIndex()
    index.load_state(state(seq=2, stored=("a",), incarnation=3))
    assert index.apply(ev(seq=3, removed=("a",), incarnation=2)) is False
    assert index.incarnation("d-0") == 3
    assert index.matched_blocks("d-0", ["a"]) == 1


def test_a_cleared_live_event_drops_everything_before_its_own_stores() -> None:
    index = KvIndex()
    index.load_state(state(seq=0, stored=("a", "b")))
    assert index.apply(ev(seq=1, stored=("c",), cleared=True))
    assert index.match_all(["a"]) == {}
    assert index.match_all(["c"]) == {"d-0": 1}


def test_removed_is_applied_before_stored_within_one_event() -> None:
    index = KvIndex()
    index.load_state(state(seq=0, stored=("a",)))
    assert index.apply(ev(seq=1, stored=("a",), removed=("a",)))
    assert index.matched_blocks("d-0", ["a"]) == 1


def test_load_state_replaces_the_previous_state_and_needs_a_cleared_reply() -> None:
    index = KvIndex()
    index.load_state(state(seq=5, stored=("a", "b")))
    index.load_state(state(seq=9, stored=("c",)))
    assert index.match_all(["a"]) == {}
    assert index.num_hashes("d-0") == 1
    assert index.last_seq("d-0") == 9
    with pytest.raises(ValueError, match="cleared"):
        index.load_state(ev(seq=10, stored=("d",)))


def test_matched_blocks_counts_leading_hits_only() -> None:
    index = KvIndex()
    index.load_state(state(stored=("h0", "h1", "h3")))
    assert index.matched_blocks("d-0", ["h0", "h1", "h2", "h3"]) == 2
    assert index.matched_blocks("d-0", ["h2", "h0"]) == 0
    assert index.matched_blocks("d-0", []) == 0
    assert index.matched_blocks("unknown", ["h0"]) == 0


def test_match_all_reports_each_worker_holding_the_first_block() -> None:
    index = KvIndex()
    index.load_state(state("a", stored=("h0", "h1", "h2")))
    index.load_state(state("b", stored=("h0", "h2")))  # misses h1: only one leading block
    index.load_state(state("c", stored=("h1", "h2")))  # misses h0: nothing usable
    index.load_state(state("d", stored=("h0", "h1")))
    assert index.match_all(["h0", "h1", "h2"]) == {"a": 3, "b": 1, "d": 2}
    assert index.match_all([]) == {}
    assert index.match_all(["zz"]) == {}


def test_forget_removes_the_worker_from_every_lookup() -> None:
    index = KvIndex()
    index.load_state(state("a", stored=("h0",)))
    index.load_state(state("b", stored=("h0",)))
    index.forget("a")
    index.forget("never-seen")
    assert index.workers() == {"b"}
    assert index.match_all(["h0"]) == {"b": 1}
    assert index.num_hashes("a") == 0
    assert index.apply(ev("a", seq=1)) is False


def test_a_worker_holds_at_most_the_cap_and_the_overflow_is_counted() -> None:
    index = KvIndex(max_hashes_per_worker=3)
    index.load_state(state(stored=("a", "b", "c", "d")))
    assert index.num_hashes("d-0") == 3
    assert index.num_dropped_hashes == 1
    assert index.apply(ev(seq=1, stored=("e",), removed=("a",)))  # room freed first
    assert index.num_hashes("d-0") == 3
    assert index.matched_blocks("d-0", ["e"]) == 1
    with pytest.raises(ValueError, match="at least 1"):
        KvIndex(max_hashes_per_worker=0)


def test_prompt_hashes_are_the_shared_block_hashes_in_hex() -> None:
    token_ids = list(range(37))
    hashes = prompt_hashes(token_ids, 16, "f" * 64, tenant_salt="t1")
    expected = block_hashes(token_ids, 16, root_hash("f" * 64, "t1"))
    assert hashes == [h.hex() for h in expected]
    assert len(hashes) == 2
    assert prompt_hashes(token_ids, 16, "f" * 64) != hashes  # the tenant salt separates caches


# A model of the index: per worker, a plain set; matched = leading run.
_hash = st.sampled_from([f"h{i}" for i in range(8)])
_worker = st.sampled_from(["a", "b", "c"])
_op: st.SearchStrategy[tuple[str, str, list[str]]] = st.one_of(
    st.tuples(st.just("load"), _worker, st.lists(_hash, max_size=6)),
    st.tuples(st.just("store"), _worker, st.lists(_hash, max_size=3)),
    st.tuples(st.just("remove"), _worker, st.lists(_hash, max_size=3)),
    st.tuples(st.just("forget"), _worker, st.just([])),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=30), prompt=st.lists(_hash, max_size=6))
def test_match_all_agrees_with_matched_blocks_and_a_set_model(
    ops: list[tuple[str, str, list[str]]], prompt: list[str]
) -> None:
    index = KvIndex()
    model: dict[str, set[str]] = {}
    seqs: dict[str, int] = {}
    for kind, worker_id, hashes in ops:
        if kind == "load":
            index.load_state(state(worker_id, seq=0, stored=tuple(hashes)))
            model[worker_id], seqs[worker_id] = set(hashes), 0
        elif kind == "forget":
            index.forget(worker_id)
            model.pop(worker_id, None)
        elif worker_id in model:
            seqs[worker_id] += 1
            stored = tuple(hashes) if kind == "store" else ()
            removed = tuple(hashes) if kind == "remove" else ()
            assert index.apply(ev(worker_id, seqs[worker_id], stored, removed))
            model[worker_id] = (model[worker_id] - set(removed)) | set(stored)
    expected: dict[str, int] = {}
    for worker_id, held in model.items():
        num = 0
        while num < len(prompt) and prompt[num] in held:
            num += 1
        assert index.matched_blocks(worker_id, prompt) == num
        assert index.num_hashes(worker_id) == len(held)
        if num:
            expected[worker_id] = num
    assert index.match_all(prompt) == expected
    assert index.workers() == set(model)
