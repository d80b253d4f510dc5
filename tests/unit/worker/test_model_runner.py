"""Model runner input preparation: the vectorised arrays equal a per-token reference."""

from __future__ import annotations

import numpy as np

from kvrail.worker.engine.model_runner import prepare_decode, prepare_prefill
from kvrail.worker.engine.scheduler_output import ScheduledRequest
from kvrail.worker.testing import make_request

BLOCK_SIZE = 4


def _item(start: int, num_new: int, block_ids: list[int]) -> ScheduledRequest:
    request = make_request(start + num_new)
    token_ids = request.prompt_token_ids[start : start + num_new]
    return ScheduledRequest(request, start, token_ids, block_ids, samples=True)


def _reference(items: list[ScheduledRequest]) -> dict[str, list[int] | list[list[int]]]:
    """The inputs one request and one token at a time."""
    width = max(len(i.block_ids) for i in items)
    ref: dict[str, list] = {k: [] for k in ("input_ids", "positions", "slot_mapping")}
    ref["query_start_loc"] = [0]
    for item in items:
        for offset, token_id in enumerate(item.token_ids):
            position = item.num_computed_tokens + offset
            block_id = item.block_ids[position // BLOCK_SIZE]
            ref["input_ids"].append(token_id)
            ref["positions"].append(position)
            ref["slot_mapping"].append(block_id * BLOCK_SIZE + position % BLOCK_SIZE)
        ref["query_start_loc"].append(len(ref["input_ids"]))
    ref["block_tables"] = [i.block_ids + [0] * (width - len(i.block_ids)) for i in items]
    ref["seq_lens"] = [i.num_computed_tokens + len(i.token_ids) for i in items]
    return ref


def test_prefill_inputs_equal_the_per_token_reference_for_irregular_chunks() -> None:
    items = [
        _item(0, 7, [5, 9]),  # fresh prompt, last block partly filled
        _item(8, 5, [3, 4, 11, 12]),  # a chunk after an 8-token prefix, crossing a block
        _item(0, 1, [7]),
        _item(3, 9, [2, 6, 8]),
    ]
    prepared = prepare_prefill(items, BLOCK_SIZE)
    for name, expected in _reference(items).items():
        array = getattr(prepared, name)
        assert array.tolist() == expected, name
    assert prepared.input_ids.dtype == np.int64 and prepared.slot_mapping.dtype == np.int64
    assert prepared.block_tables.dtype == np.int32 and prepared.seq_lens.dtype == np.int32
    assert prepared.query_start_loc.dtype == np.int32


def test_decode_inputs_equal_the_per_token_reference() -> None:
    items = [_item(12, 1, [4, 5, 6, 7]), _item(0, 1, [9]), _item(4, 1, [1, 3])]
    prepared = prepare_decode(items, BLOCK_SIZE)
    for name, expected in _reference(items).items():
        assert getattr(prepared, name).tolist() == expected, name
    assert prepared.num_tokens == 3


def test_no_requests_give_empty_inputs_with_a_one_wide_block_table() -> None:
    prepared = prepare_prefill([], BLOCK_SIZE)
    assert prepared.num_tokens == 0
    assert prepared.block_tables.shape == (0, 1)
    assert prepared.query_start_loc.tolist() == [0]
    assert prepared.seq_lens.shape == (0,)
