"""Triton kernel: the first blocks that decode rows share, attended once per group of rows.

Decode rows whose block tables begin with the same physical blocks (`SharedPrefixes`: the `n`
choices of one prompt after its one prefill, requests whose system prompt the prefix cache
holds) would each read those blocks' K and V. Here one program per (KV head, group) reads them
once, for every query head of its KV head's group in every member row (8 choices under Llama-3's
GQA of 4: 32 query rows in one dot, where the decode kernel pads 4 to 16), with the decode
kernel's tile step (`paged_kv.attend_tile`: the same online softmax, the same FP8 handling). It
stores each row's partial (max, sum, unnormalised acc) in slot 0 of the decode kernel's partials;
`decode_attention._decode_kernel` attends each row's own tokens, past the shared ones, into the
slots after, and its reduce merges them (`decode_attention.paged_decode_attention(prefix=...)`).
The grid is fixed by the hint's shape, so a captured graph serves any grouping: a group with no
tokens and rows of -1 stores nothing. The decode step's speed with and without it:
bench/engine/gpu_choices.py.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvrail.kernels.launch import pdl
from kvrail.kernels.paged_kv import attend_tile, cache_strides, decode_query
from kvrail.kernels.reference import FP8_DTYPES
from kvrail.kernels.shared_prefix import SharedPrefixes


@triton.jit(do_not_specialize=["stride_bt", "num_slots"])
def _prefix_kernel(
    query,
    k_cache,
    v_cache,
    block_tables,
    group_rows,
    group_tokens,
    part_ml,
    part_acc,
    scale,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    block_size,
    group,
    head_dim,
    num_heads,
    num_slots,
    MEMBERS: tl.constexpr,
    ROWS: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_WORDS: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # see kvrail.kernels.launch; the decode kernel is let in after the main loop
        gdc_wait()
    kvh = tl.program_id(0)
    grp = tl.program_id(1)
    tokens = tl.load(group_tokens + grp)
    r = tl.arange(0, ROWS)  # query row r: member r // group, head r % group of this KV head's
    member = r // group
    row = tl.load(group_rows + grp * MEMBERS + member, mask=member < MEMBERS, other=-1)
    valid = row >= 0
    row = tl.maximum(row, 0).to(tl.int64)
    heads = kvh * group + r % group
    d = tl.arange(0, D_PAD)
    d_mask = d < head_dim
    q_mask = valid[:, None] & d_mask[None, :]
    q = tl.load(
        query + row[:, None] * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    q = decode_query(q, k_cache, scale, KV_FP8)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    leader = tl.maximum(tl.load(group_rows + grp * MEMBERS), 0).to(tl.int64)
    table = block_tables + leader * stride_bt  # the shared blocks are the same in every row's
    for start in range(0, tokens, BLOCK_N):
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_cache, v_cache, table, start, tokens,
                                    scale, kvh, stride_kb, stride_ks, stride_kh, stride_vb,
                                    stride_vs, stride_vh, block_size, d, d_mask, BLOCK_N, D_PAD,
                                    IEEE, KV_FP8, KV_WORDS)  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    part = row * num_heads + heads  # slot 0 of part_ml [S, Hq, 2, slots], part_acc [S, Hq, slots,
    # D_PAD]
    tl.store(part_ml + (part * 2) * num_slots, m_i, mask=valid)
    tl.store(part_ml + (part * 2 + 1) * num_slots, l_i, mask=valid)
    tl.store(part_acc + (part * num_slots * D_PAD)[:, None] + d[None, :], acc, mask=valid[:, None])


def check_prefix(prefix: SharedPrefixes, num_seqs: int) -> None:
    """The hint's shapes and dtypes (its contents are the engine's to get right: see
    `kvrail.kernels.shared_prefix.check_shared_prefixes`, which the reference runs)."""
    rows, tokens, starts = prefix
    if rows.dim() != 2 or tokens.shape != (rows.shape[0],) or starts.shape != (num_seqs,):
        raise ValueError(
            f"prefix rows {tuple(rows.shape)}, tokens {tuple(tokens.shape)}, starts "
            f"{tuple(starts.shape)} are not [G, M], [G], [{num_seqs}]"
        )
    if any(t.dtype != torch.int32 or not t.is_contiguous() for t in prefix):
        raise ValueError("prefix rows, tokens and starts must be contiguous int32")


def launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix: SharedPrefixes,
    part_ml: torch.Tensor,
    part_acc: torch.Tensor,
    scale: float,
    words: bool,
    ieee: bool,
) -> None:
    """Slot 0 of the partials for every row of a group in `prefix` (the decode kernel's own
    launcher calls this; `words`: the cache read as int32 words, `ieee`: float32 dots)."""
    check_prefix(prefix, query.shape[0])
    num_groups, members = prefix.rows.shape
    if num_groups == 0 or members == 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    on = pdl(query.device)
    _prefix_kernel[(num_kv_heads, num_groups)](
        query,
        k_cache,
        v_cache,
        block_tables,
        prefix.rows,
        prefix.tokens,
        part_ml,
        part_acc,
        scale,
        query.stride(0),
        query.stride(1),
        *cache_strides(k_cache, v_cache, words),
        block_tables.stride(0),
        k_cache.shape[1],
        group,
        head_dim,
        num_heads,
        part_ml.shape[3],
        MEMBERS=members,
        ROWS=max(16, triton.next_power_of_2(members * group)),
        D_PAD=part_acc.shape[3],
        BLOCK_N=64 if head_dim <= 128 else 32,
        IEEE=ieee,
        KV_FP8=k_cache.dtype in FP8_DTYPES,
        KV_WORDS=words,
        PDL=on,
        launch_pdl=on,
        num_warps=4,
        num_stages=2,
    )
