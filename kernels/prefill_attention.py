"""Triton kernel: causal prefill attention of packed query chunks over a paged context.

Same contract as `kvrail.kernels.reference.paged_prefill_attention` (the context already holds the
queries' own KV, so a chunk after a cached prefix or after earlier chunks is the same case). One
program per (BLOCK_M-query tile, sequence, query head), online softmax in float32, key tiles only
up to the tile's last position. An FP8 cache is read in FP8 and each tile converted to the
query's dtype (`kvrail.kernels.paged_kv.compute_dtype`).

`tiled_prefill_attention` is the same kernel over a tile map (`kvrail.kernels.tile_map`): its grid
is (KV head, map entry), not the step's chunk sizes, so one launch serves every step of a
captured mixed CUDA graph, whatever its chunks. Decode tokens are one-token chunks there. A tile's
rows are its tokens times the KV head's query heads, which share every K and V load; the two maps
give short chunks (decodes among them) 16-row tiles and long ones 64-row tiles.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrail.kernels.paged_kv import check_paged_inputs, compute_dtype, paged_load
from kvrail.kernels.reference import FP8_DTYPES
from kvrail.kernels.tile_map import LONG_BLOCK_M, SHORT_BLOCK_M, tile_rows


# The table width varies from step to step in eager steps: not specialized on, so it never
# compiles another variant while serving (see kvrail.worker.engine.cuda_graph).
@triton.jit(do_not_specialize=["stride_bt", "stride_tm"])
def _prefill_kernel(
    query,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    tile_map,
    out,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_tm,
    block_size,
    group,
    head_dim,
    tile_tokens,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    SKIP_FRESH: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    TILE_MAP: tl.constexpr,
):
    m = tl.arange(0, BLOCK_M)
    if TILE_MAP:
        # (KV head, map entry): the map names the sequence (-1: none) and its tile; a tile's
        # BLOCK_M rows are `tile_tokens` query tokens times the KV head's `group` query heads,
        # which share every K and V load (a decode token fills `group` rows, not one of 16)
        kvh = tl.program_id(0)
        entry = tl.program_id(1)
        s = tl.load(tile_map + entry)
        if s < 0:
            return
        tile = tl.load(tile_map + stride_tm + entry)
        tok = tile * tile_tokens + m // group
        head = kvh * group + m % group
        in_tile = m < tile_tokens * group
    else:
        tile = tl.program_id(0)
        s = tl.program_id(1)
        hq = tl.program_id(2)
        kvh = hq // group
        tok = tile * BLOCK_M + m
        head = hq + m * 0
        in_tile = m < BLOCK_M
    q_start = tl.load(query_start_loc + s)
    q_len = tl.load(query_start_loc + s + 1) - q_start
    seq_len = tl.load(seq_lens + s)
    if tile * tile_tokens >= q_len:
        return
    if SKIP_FRESH and q_len == seq_len:
        return
    m_mask = in_tile & (tok < q_len)
    pos = seq_len - q_len + tok
    d = tl.arange(0, D_PAD)
    d_mask = d < head_dim
    rows = (q_start + tok).to(tl.int64)
    q_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(
        query + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if not KV_FP8:
        q = q.to(k_cache.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables + s.to(tl.int64) * stride_bt
    end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * tile_tokens)
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < seq_len
        phys = tl.load(table + n // block_size, mask=n_mask, other=0).to(tl.int64)
        within = (n % block_size).to(tl.int64)
        k = paged_load(k_cache, phys, within, kvh, stride_kb, stride_ks, stride_kh, d, n_mask,
                       d_mask, False, D_PAD)  # fmt: skip
        if KV_FP8:  # read in FP8, computed in the query's dtype
            k = k.to(q.dtype)
        if IEEE:  # noqa: SIM108 - a constexpr branch, kept explicit for the Triton compiler
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        visible = n_mask[None, :] & (n[None, :] <= pos[:, None])
        scores = tl.where(visible, scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = paged_load(v_cache, phys, within, kvh, stride_vb, stride_vs, stride_vh, d, n_mask,
                       d_mask, False, D_PAD)  # fmt: skip
        if KV_FP8:
            v = v.to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    result = acc / l_i[:, None]
    tl.store(
        out + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        result.to(out.dtype.element_ty),
        mask=q_mask,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    skip_fresh: bool = False,
) -> torch.Tensor:
    """`max_query_len` sizes the grid; computed from query_start_loc (a host sync) if None.
    `skip_fresh` leaves the rows of chunks without a prefix unwritten (see the reference)."""
    num_seqs = seq_lens.shape[0]
    group, head_dim = check_paged_inputs(query, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} is not [{num_seqs + 1}]")
    out = torch.empty_like(query)
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = LONG_BLOCK_M if max_query_len >= LONG_BLOCK_M else SHORT_BLOCK_M
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, query.shape[1])
    _launch(grid, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, None, out,
            scale, group, head_dim, block_m, block_m, skip_fresh)  # fmt: skip
    return out


def tiled_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    short_tiles: torch.Tensor,
    long_tiles: torch.Tensor,
) -> torch.Tensor:
    """The rows of every tile in `short_tiles` and `long_tiles` ([2, n] int32, as
    `kvrail.kernels.tile_map` fills them), as `paged_prefill_attention` computes them; rows no
    tile covers (a captured graph's padding) are 0. No host synchronisation: the grids are the
    maps' lengths."""
    num_seqs = seq_lens.shape[0]
    group, head_dim = check_paged_inputs(query, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    out = torch.zeros_like(query)
    for tiles, rows in zip((short_tiles, long_tiles), tile_rows(group), strict=True):
        if tiles.shape[1]:
            grid = (k_cache.shape[2], tiles.shape[1])
            _launch(grid, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                    tiles, out, scale, group, head_dim, rows, rows // group, False)  # fmt: skip
    return out


def _launch(
    grid: tuple[int, ...],
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tiles: torch.Tensor | None,
    out: torch.Tensor,
    scale: float,
    group: int,
    head_dim: int,
    block_m: int,
    tile_tokens: int,
    skip_fresh: bool,
) -> None:
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        seq_lens if tiles is None else tiles,  # not read without a map
        out,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        0 if tiles is None else tiles.stride(0),
        k_cache.shape[1],
        group,
        head_dim,
        tile_tokens,
        BLOCK_M=block_m,
        BLOCK_N=64 if head_dim <= 128 else 32,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        SKIP_FRESH=skip_fresh,
        IEEE=compute_dtype(query, k_cache) == torch.float32,
        KV_FP8=k_cache.dtype in FP8_DTYPES,
        TILE_MAP=tiles is not None,
    )
