"""Every Triton kernel against its torch reference: on CPU under TRITON_INTERPRET=1 (small,
irregular shapes) and, under the `gpu` marker, on CUDA. Inputs are seeded; tolerances by dtype."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvrail.kernels import reference
from kvrail.kernels.testing import load_kernels

HAS_CUDA = torch.cuda.is_available()
_MODULES = load_kernels()  # interpreted on CPU when there is no CUDA
KV_WRITE, DECODE, PREFILL, BLOCK_COPY = (
    _MODULES[n] for n in ("kv_write", "decode_attention", "prefill_attention", "block_copy")
)
DEVICE = "cuda" if HAS_CUDA else "cpu"
TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SHAPES = [  # (block_size, Hq, Hkv, D): page sizes 1 and 16, GQA 1/3/4, irregular head dim
    pytest.param(16, 4, 1, 16, id="bs16-gqa4-d16"),
    pytest.param(1, 3, 3, 16, id="bs1-mha-d16"),
    pytest.param(5, 6, 2, 24, id="bs5-gqa3-d24"),
]
DTYPES = [torch.float32] if not HAS_CUDA else [torch.float32, torch.float16, torch.bfloat16]


def _region(num_blocks: int, bs: int, hkv: int, d: int, dtype: torch.dtype, g: torch.Generator):
    """A worker-style region [blocks, layers=2, 2, bs, Hkv, D]; returns it and layer 1's views."""
    region = torch.randn(num_blocks, 2, 2, bs, hkv, d, generator=g).to(DEVICE, dtype)
    return region, region[:, 1, 0], region[:, 1, 1]


def _tables(seq_lens: list[int], bs: int, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    width = max(-(-s // bs) for s in seq_lens) + 1  # one extra padded column
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = perm[: len(seq_lens) * width].reshape(len(seq_lens), width)
    return tables.to(DEVICE, torch.int32)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_kernels_run_interpreted_on_cpu() -> None:
    if HAS_CUDA:
        pytest.skip("CUDA present: kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(DECODE._decode_kernel, InterpretedFunction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bs", "hq", "hkv", "d"), SHAPES)
def test_decode_attention_matches_reference(bs: int, hq: int, hkv: int, d: int, dtype) -> None:
    g = torch.Generator().manual_seed(bs * 100 + hq)
    seq_lens = [1, 7, 40, 33]
    _, k_cache, v_cache = _region(200, bs, hkv, d, dtype, g)
    tables = _tables(seq_lens, bs, 200, g)
    query = torch.randn(len(seq_lens), hq, d, generator=g).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (query, k_cache, v_cache, tables, lens, d**-0.5)
    _close(DECODE.paged_decode_attention(*args), reference.paged_decode_attention(*args))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
def test_split_k_decode_merges_uneven_and_empty_splits_exactly(num_splits: int) -> None:
    """Contexts that do not divide by the split count, and more splits than 32-token slices (so
    trailing splits are empty), reduce to the reference; the result does not depend on splits."""
    g = torch.Generator().manual_seed(num_splits)
    seq_lens = [1, 33, 95, 130, 64]
    _, k_cache, v_cache = _region(200, 5, 2, 24, torch.float32, g)
    tables = _tables(seq_lens, 5, 200, g)
    query = torch.randn(len(seq_lens), 6, 24, generator=g).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (query, k_cache, v_cache, tables, lens, 24**-0.5)
    split = DECODE.paged_decode_attention(*args, num_splits=num_splits)
    _close(split, reference.paged_decode_attention(*args))
    _close(split, DECODE.paged_decode_attention(*args, num_splits=1))
    assert torch.equal(split, DECODE.paged_decode_attention(*args, num_splits=num_splits))
    # a register cap (a tuning knob: spills on a GPU, nothing interpreted) computes the same
    capped = DECODE.paged_decode_attention(*args, num_splits=num_splits, max_registers=64)
    _close(capped, split)
    with pytest.raises(ValueError, match="max_registers"):
        DECODE.paged_decode_attention(*args, max_registers=8)


def _shared_prefix_batch(dtype: torch.dtype, g: torch.Generator, bs: int = 4):
    """Decode args and a hint: rows 0, 1, 2, 4 share 3 blocks, row 3 2 (its context ends in the
    third, so it has a group of its own), rows 5-6 share 1, row 7 nothing; and a padded group (no
    tokens, no rows), as a captured graph has."""
    from kvrail.kernels.shared_prefix import SharedPrefixes

    hq, hkv, d = 6, 2, 24
    _, k_cache, v_cache = _region(120, bs, hkv, d, dtype, g)
    tables = [[7, 9, 11, 20 + i, 40 + i] for i in range(5)] + [[13, 50, 51], [13, 52, 53]]
    tables[3] = [7, 9, 11, 23]
    tables.append([60, 61])
    seq_lens = [12 + 1, 12 + 5, 12 + 8, 10, 12 + 2, 4 + 3, 4 + 8, 6]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(len(seq_lens), hq, d, generator=g).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (query, k_cache, v_cache, padded.to(DEVICE), lens, d**-0.5)
    rows = [[0, 1, 2, 4], [5, 6, -1, -1], [3, -1, -1, -1], [-1] * 4]
    hint = SharedPrefixes(
        *(torch.tensor(v, dtype=torch.int32, device=DEVICE)
          for v in (rows, [12, 4, 8, 0], [12, 12, 12, 8, 12, 4, 4, 0]))
    )  # fmt: skip
    return args, hint


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_sharing_their_first_blocks_attend_them_once_with_the_same_result(
    dtype, num_splits: int
) -> None:
    """The hinted launch matches the reference and the launch without the hint; the reference's
    check rejects a group that claims more than a member shares, and the launcher a hint of
    another dtype."""
    g = torch.Generator().manual_seed(11)
    args, hint = _shared_prefix_batch(dtype, g)
    got = DECODE.paged_decode_attention(*args, num_splits=num_splits, prefix=hint)
    _close(got, reference.paged_decode_attention(*args, prefix=hint))
    _close(got, DECODE.paged_decode_attention(*args, num_splits=num_splits))
    wrong = hint._replace(tokens=torch.tensor([12, 4, 12, 0], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="row 3 does not share"):
        reference.paged_decode_attention(*args, prefix=wrong)
    with pytest.raises(ValueError, match="contiguous int32"):
        DECODE.paged_decode_attention(*args, prefix=hint._replace(rows=hint.rows.long()))


def test_split_count_fills_the_gpu_and_never_splits_below_a_minimum_slice() -> None:
    choose = DECODE.choose_num_splits
    assert choose(1, 8, 9216, 132) == 33  # batch 1: 8 programs alone -> 264, 2 per SM
    assert choose(16, 8, 9216, 132) == 3  # 128 programs -> 384, about 2 per SM
    assert choose(32, 8, 9216, 132) == 1  # 256 programs: every SM has one already
    assert choose(16, 8, 9216, 200) == 4  # 128 programs on 200 SMs -> 512
    assert choose(1, 8, 9216, 1000) == DECODE.MAX_SPLITS
    assert choose(256, 8, 9216, 132) == 1  # the batch fills the GPU
    assert choose(1, 8, 40, 132) == 2  # a 40-token bound: slices of at least 32 tokens
    assert choose(0, 8, 40, 132) == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bs", "hq", "hkv", "d"), SHAPES)
def test_prefill_attention_over_paged_prefix_matches_reference(bs, hq, hkv, d, dtype) -> None:
    g = torch.Generator().manual_seed(bs * 10 + hkv)
    # (query chunk, context): a whole prompt, a chunk after a prefix, a single token, a long one.
    chunks = [(9, 9), (5, 37), (1, 18), (20, 20)]
    _, k_cache, v_cache = _region(200, bs, hkv, d, dtype, g)
    tables = _tables([c for _, c in chunks], bs, 200, g)
    qsl = torch.tensor(
        [0] + list(torch.tensor([q for q, _ in chunks]).cumsum(0)), dtype=torch.int32, device=DEVICE
    )
    query = torch.randn(int(qsl[-1]), hq, d, generator=g).to(DEVICE, dtype)
    lens = torch.tensor([c for _, c in chunks], dtype=torch.int32, device=DEVICE)
    args = (query, k_cache, v_cache, tables, qsl, lens, d**-0.5)
    expected = reference.paged_prefill_attention(*args)
    _close(PREFILL.paged_prefill_attention(*args), expected)
    # skip_fresh leaves whole-prompt chunks (0 and 3) to the caller's SDPA: the rest still match
    skipped = PREFILL.paged_prefill_attention(*args, skip_fresh=True)
    _close(skipped[9:15], expected[9:15])
    ref_skipped = reference.paged_prefill_attention(*args, skip_fresh=True)
    _close(ref_skipped[9:15], expected[9:15])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bs", "hq", "hkv", "d"), SHAPES)
def test_tiled_prefill_attention_matches_the_reference_and_leaves_padding_zero(
    bs, hq, hkv, d, dtype
) -> None:
    """A captured mixed step's attention: decode tokens as one-token chunks, a short and a long
    chunk (16- and 64-query tiles), maps padded with -1 past their tiles, rows past the chunks."""
    from kvrail.kernels.tile_map import fill_tile_maps, tile_capacities

    g = torch.Generator().manual_seed(bs + hkv)
    chunks = [(1, 30), (1, 7), (20, 45), (70, 70), (1, 1)]  # (query, context)
    _, k_cache, v_cache = _region(400, bs, hkv, d, dtype, g)
    tables = _tables([c for _, c in chunks], bs, 400, g)
    starts = [0] + torch.tensor([q for q, _ in chunks]).cumsum(0).tolist()
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    padded = starts[-1] + 9  # rows past the chunks, as a graph's padding
    query = torch.randn(padded, hq, d, generator=g).to(DEVICE, dtype)
    lens = torch.tensor([c for _, c in chunks], dtype=torch.int32, device=DEVICE)
    short_cap, long_cap = tile_capacities(128, 8, hq // hkv)
    short = np.zeros((2, short_cap), np.int32)
    long = np.zeros((2, long_cap), np.int32)
    fill_tile_maps(np.diff(starts), short, long, hq // hkv)
    out = PREFILL.tiled_prefill_attention(
        query, k_cache, v_cache, tables, qsl, lens, d**-0.5,
        torch.from_numpy(short).to(DEVICE), torch.from_numpy(long).to(DEVICE),
    )  # fmt: skip
    args = (query[: starts[-1]], k_cache, v_cache, tables, qsl, lens, d**-0.5)
    _close(out[: starts[-1]], reference.paged_prefill_attention(*args))
    assert bool((out[starts[-1] :] == 0).all())


@pytest.mark.parametrize(("bs", "hq", "hkv", "d"), SHAPES)
def test_kv_write_fills_exactly_the_mapped_slots(bs: int, hq: int, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(bs)
    region, k_cache, v_cache = _region(40, bs, hkv, d, torch.float32, g)
    expected_region, ek, ev = region.clone(), None, None
    ek, ev = expected_region[:, 1, 0], expected_region[:, 1, 1]
    slots = torch.randperm(40 * bs, generator=g)[:11].to(DEVICE)
    slots[3] = -1  # skipped
    key = torch.randn(11, hkv, d, generator=g).to(DEVICE)
    value = torch.randn(11, hkv, d, generator=g).to(DEVICE)
    KV_WRITE.write_kv(key, value, k_cache, v_cache, slots)
    reference.write_kv(key, value, ek, ev, slots)
    assert torch.equal(region, expected_region)


def test_block_gather_and_scatter_round_trip_through_a_packed_buffer() -> None:
    g = torch.Generator().manual_seed(3)
    region = torch.randn(300, 2, 2, 3, 2, 24, generator=g).to(DEVICE)
    ids = torch.tensor([299, 0, 17, 150, 3], dtype=torch.int64, device=DEVICE)
    packed = BLOCK_COPY.gather_blocks(region, ids)
    assert torch.equal(packed, reference.gather_blocks(region, ids))
    target = torch.zeros_like(region)
    BLOCK_COPY.scatter_blocks(packed, target, ids)
    expected = torch.zeros_like(region)
    reference.scatter_blocks(packed, expected, ids)
    assert torch.equal(target, expected)
    assert torch.equal(target[ids], region[ids])


def test_copy_blocks_moves_scattered_blocks_between_two_regions_in_one_launch() -> None:
    g = torch.Generator().manual_seed(4)
    src = torch.randn(300, 2, 2, 3, 2, 24, generator=g).to(DEVICE)
    src_ids = torch.tensor([299, 0, 17, 150, 3], dtype=torch.int64, device=DEVICE)
    dst_ids = torch.tensor([5, 6, 299, 1, 100], dtype=torch.int64, device=DEVICE)
    dst = torch.zeros(320, 2, 2, 3, 2, 24, device=DEVICE)
    BLOCK_COPY.copy_blocks(src, dst, src_ids, dst_ids)
    expected = torch.zeros_like(dst)
    reference.copy_blocks(src, expected, src_ids, dst_ids)
    assert torch.equal(dst, expected)
    assert torch.equal(dst[dst_ids], src[src_ids])
    untouched = torch.ones(320, dtype=torch.bool)
    untouched[dst_ids.cpu()] = False
    assert not dst[untouched.to(DEVICE)].any()  # nothing else was written


def test_copy_blocks_skips_padding_pairs() -> None:
    """A negative id pads a captured launch's id list (worker/transfer/ipc_copy.py): that pair
    copies nothing, in the kernel as in the reference."""
    g = torch.Generator().manual_seed(5)
    src = torch.randn(40, 2, 24, generator=g).to(DEVICE)
    src_ids = torch.tensor([7, -1, 3, -1], dtype=torch.int64, device=DEVICE)
    dst_ids = torch.tensor([1, -1, 30, -1], dtype=torch.int64, device=DEVICE)
    dst = torch.zeros(40, 2, 24, device=DEVICE)
    BLOCK_COPY.copy_blocks(src, dst, src_ids, dst_ids)
    expected = torch.zeros_like(dst)
    reference.copy_blocks(src, expected, src_ids, dst_ids)
    assert torch.equal(dst, expected)
    assert torch.equal(dst[[1, 30]], src[[7, 3]])
    dst[[1, 30]] = 0
    assert not dst.any()  # the padding wrote nothing (no block -1, the last, either)


BAD_CALLS: list[tuple[str, Callable[[], object]]] = [
    (
        "decode with heads not a multiple of KV heads",
        lambda: DECODE.paged_decode_attention(
            torch.zeros(1, 3, 16),
            torch.zeros(4, 2, 2, 16),
            torch.zeros(4, 2, 2, 16),
            torch.zeros(1, 2, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            1.0,
        ),
    ),
    (
        "decode with a block table row missing",
        lambda: DECODE.paged_decode_attention(
            torch.zeros(2, 2, 16),
            torch.zeros(4, 2, 2, 16),
            torch.zeros(4, 2, 2, 16),
            torch.zeros(1, 2, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32),
            1.0,
        ),
    ),
    (
        "kv write with a short slot mapping",
        lambda: KV_WRITE.write_kv(
            torch.zeros(3, 2, 16),
            torch.zeros(3, 2, 16),
            torch.zeros(4, 2, 2, 16),
            torch.zeros(4, 2, 2, 16),
            torch.zeros(2, dtype=torch.int64),
        ),
    ),
    (
        "gather from a non-contiguous region",
        lambda: BLOCK_COPY.gather_blocks(
            torch.zeros(4, 8)[:, ::2], torch.zeros(1, dtype=torch.int64)
        ),
    ),
]


@pytest.mark.parametrize(("case", "call"), BAD_CALLS, ids=[c for c, _ in BAD_CALLS])
def test_launchers_reject_bad_shapes_and_strides(case: str, call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the messages differ per check
        call()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_decode_attention_matches_reference_on_a_full_gpu_grid() -> None:
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 3000, (64,), generator=g).tolist()
    _, k_cache, v_cache = _region(13000, 16, 8, 128, torch.bfloat16, g)
    tables = _tables(seq_lens, 16, 13000, g)
    query = torch.randn(64, 32, 128, generator=g).to(DEVICE, torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (query, k_cache, v_cache, tables, lens, 128**-0.5)
    expected = reference.paged_decode_attention(*args)
    _close(DECODE.paged_decode_attention(*args), expected)
    for num_splits in (1, 5, 64):
        _close(DECODE.paged_decode_attention(*args, num_splits=num_splits), expected)
    # batch 1 (the split-K case the engine's CUDA graphs hit) over a long, uneven context
    longest = tables.shape[1] * 16 - 7  # as long as the table row allows, not a block multiple
    one = (query[:1], k_cache, v_cache, tables[:1], lens[:1].clone().fill_(longest), 128**-0.5)
    _close(DECODE.paged_decode_attention(*one), reference.paged_decode_attention(*one))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_prefill_attention_matches_reference_on_a_full_gpu_grid() -> None:
    g = torch.Generator().manual_seed(1)
    chunks = [(2048, 2048), (512, 3000), (1, 700), (1000, 1000)]
    _, k_cache, v_cache = _region(800, 16, 8, 128, torch.bfloat16, g)
    tables = _tables([c for _, c in chunks], 16, 800, g)
    starts = [0] + torch.tensor([q for q, _ in chunks]).cumsum(0).tolist()
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    query = torch.randn(starts[-1], 32, 128, generator=g).to(DEVICE, torch.bfloat16)
    lens = torch.tensor([c for _, c in chunks], dtype=torch.int32, device=DEVICE)
    args = (query, k_cache, v_cache, tables, qsl, lens, 128**-0.5)
    _close(PREFILL.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_tiled_prefill_attention_matches_reference_on_a_chat_step() -> None:
    """A mixed step of the Llama-3-8B shape: 64 decodes, a 600-token prompt, a chunk after a
    3,000-token prefix, tile maps sized for a 2,048-token graph."""
    from kvrail.kernels.tile_map import fill_tile_maps, tile_capacities

    g = torch.Generator().manual_seed(2)
    chunks = [(1, 700 + i) for i in range(64)] + [(600, 600), (512, 3000)]
    _, k_cache, v_cache = _region(13000, 16, 8, 128, torch.bfloat16, g)
    tables = _tables([c for _, c in chunks], 16, 13000, g)
    starts = [0] + torch.tensor([q for q, _ in chunks]).cumsum(0).tolist()
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    query = torch.randn(2048, 32, 128, generator=g).to(DEVICE, torch.bfloat16)
    lens = torch.tensor([c for _, c in chunks], dtype=torch.int32, device=DEVICE)
    short_cap, long_cap = tile_capacities(2048, 256, 4)
    short = np.zeros((2, short_cap), np.int32)
    long = np.zeros((2, long_cap), np.int32)
    fill_tile_maps(np.diff(starts), short, long, 4)
    out = PREFILL.tiled_prefill_attention(
        query, k_cache, v_cache, tables, qsl, lens, 128**-0.5,
        torch.from_numpy(short).to(DEVICE), torch.from_numpy(long).to(DEVICE),
    )  # fmt: skip
    args = (query[: starts[-1]], k_cache, v_cache, tables, qsl, lens, 128**-0.5)
    _close(out[: starts[-1]], reference.paged_prefill_attention(*args))
    assert bool((out[starts[-1] :] == 0).all())
