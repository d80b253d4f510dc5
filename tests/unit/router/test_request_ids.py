"""The router's request ids: 128 random bits each, in hex, never repeated (read from the OS in
batches, so the event loop gives up the GIL once per batch, not once per request)."""

from __future__ import annotations

import re

from kvrail.router.app import RandomIds


def test_ids_are_128_bit_hex_and_distinct_across_batches() -> None:
    ids = RandomIds(batch=8)
    seen = [ids.next() for _ in range(1000)]  # 125 batches
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in seen)
    assert len(set(seen)) == len(seen)
    assert len({i[:8] for i in seen}) > 990  # no shared structure between ids of a batch
