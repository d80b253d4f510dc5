from __future__ import annotations

import pytest

from kvrail.keys import PoolKeys


def test_every_key_and_subject_is_scoped_by_namespace_and_pool() -> None:
    k = PoolKeys("team-a", "llama")
    assert k.worker("decode-0") == "/kvrail/v1/team-a/llama/workers/decode-0"
    assert k.worker("decode-0").startswith(k.pool_prefix)
    subjects = [k.decode_requests("d-0"), k.cancel, k.kv_events("d-0"), k.kv_state("d-0"),
                k.prefill_any, k.prefill_to("p-0"), *k.prefill_subjects,
                k.kv_events_all]  # fmt: skip
    assert all(s.startswith("kvrail.team-a.llama.") for s in subjects)
    assert k.prefill_to("p-0") != k.prefill_any
    assert k.prefill_stream == "KVRAIL-team-a-llama-PREFILL"


def test_pools_whose_names_share_a_prefix_do_not_share_keys() -> None:
    assert (
        not PoolKeys("ns", "pool-ab").worker("w").startswith(PoolKeys("ns", "pool-a").pool_prefix)
    )


def test_worker_id_round_trips_and_foreign_keys_are_refused() -> None:
    k = PoolKeys("ns", "p")
    assert k.worker_id_of(k.worker("w-1")) == "w-1"
    with pytest.raises(ValueError, match="not a worker key"):
        k.worker_id_of(PoolKeys("ns", "q").worker("w-1"))


@pytest.mark.parametrize("bad", ["", "UPPER", "a.b", "a/b", "a*", "a>", "-a", "x" * 64])
def test_names_that_could_escape_their_scope_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="DNS-1123"):
        PoolKeys("ns", "p").worker(bad)
    with pytest.raises(ValueError, match="DNS-1123"):
        PoolKeys(bad, "p")
    with pytest.raises(ValueError, match="DNS-1123"):
        PoolKeys("ns", bad)
