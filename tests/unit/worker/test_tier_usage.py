"""The worker record's `kv_tiers`, built from the engine's tier counts."""

from __future__ import annotations

import pytest

from kvrail.codec import decode
from kvrail.messages import KvTierUsage, WorkerRecord
from kvrail.worker.tier_usage import kv_tier_usage


def test_lower_tiers_come_fastest_first_with_their_counters_and_the_gpu_left_out() -> None:
    got = kv_tier_usage(
        {"disk": (10, 100, 1), "gpu": (5, 50, 2), "host": (30, 60, 3)},
        hits={"host": 7},
        loads={"host": 2, "disk": 1},
    )
    assert got == (
        KvTierUsage("host", 30, 60, 3, num_hit_blocks=7, num_loads=2),
        KvTierUsage("disk", 10, 100, 1, num_hit_blocks=0, num_loads=1),
    )


def test_a_worker_without_tiers_reports_none() -> None:
    assert kv_tier_usage({}) == ()
    assert kv_tier_usage({"gpu": (1, 2, 3)}, hits={"host": 4}) == ()


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="used_bytes"):
        kv_tier_usage({"host": (-1, 60, 3)})


def test_the_usage_travels_in_the_worker_record() -> None:
    record = WorkerRecord(
        worker_id="d-0", pod_uid="u", incarnation=1, role="decode", fingerprint="f",
        kv_tiers=kv_tier_usage({"host": (1 << 20, 1 << 30, 16)}, loads={"host": 3}),
    )  # fmt: skip
    assert decode(record.encode(), WorkerRecord).kv_tiers[0].num_loads == 3
