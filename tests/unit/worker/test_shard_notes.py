"""A sharded KV write's notifications: the payload is handed over once every shard arrived, exactly
once, whatever the order; a missing shard keeps it back; a frame of another layout is refused."""

from __future__ import annotations

import itertools

import pytest

from kvrail.worker.transfer.shard_notes import ShardAssembler, ShardFrameError, frame, unframe


def test_a_frame_round_trips() -> None:
    assert unframe(frame("agent:7", 2, 4, b"payload")) == ("agent:7", 2, 4, b"payload")
    assert unframe(frame("k", 0, 1)) == ("k", 0, 1, b"")


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_the_payload_comes_once_every_shard_arrived_in_any_order(order: tuple[int, ...]) -> None:
    assembler = ShardAssembler(3)
    out = [assembler.add(frame("k", r, 3, b"done" if r == 0 else b""), 0.0) for r in order]
    assert out == [None, None, b"done"]
    assert assembler.num_pending == 0
    assert assembler.add(frame("k", 1, 3), 0.0) is None  # a late duplicate starts nothing new


def test_a_missing_shard_keeps_the_payload_back_until_it_is_forgotten() -> None:
    assembler = ShardAssembler(2, max_age_s=10.0)
    assert assembler.add(frame("a", 0, 2, b"done"), 0.0) is None
    assert assembler.add(frame("b", 0, 2, b"other"), 5.0) is None
    assert assembler.num_pending == 2
    assert assembler.add(frame("b", 1, 2), 11.0) == b"other"  # "a" expired meanwhile
    assert assembler.num_pending == 0
    assert assembler.add(frame("a", 1, 2), 11.0) is None  # its shard 0 is long forgotten


@pytest.mark.parametrize(
    "note",
    [b"a plain PrefillDone from a one-device worker", frame("k", 0, 3), frame("k", 1, 1)[:-3]],
)
def test_a_note_of_another_layout_or_no_frame_is_refused(note: bytes) -> None:
    with pytest.raises(ShardFrameError):
        ShardAssembler(2).add(note, 0.0)
