"""Triton kernel: paged decode attention, one query token per sequence.

Same contract as `kvrail.kernels.reference.paged_decode_attention`. One program per (sequence,
KV head) computes all the query heads of that KV head's group at once, walking the context in
BLOCK_N-token tiles through the block table with an online softmax (float32 accumulators).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    out,
    scale,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
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
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens + s)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    d_mask = d < head_dim
    q_mask = (g < group)[:, None] & d_mask[None, :]
    heads = kvh * group + g
    q = tl.load(
        query + s * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    q = q.to(k_cache.dtype.element_ty)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = block_tables + s.to(tl.int64) * stride_bt
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < seq_len
        phys = tl.load(table + n // block_size, mask=n_mask, other=0).to(tl.int64)
        within = (n % block_size).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache
            + phys[:, None] * stride_kb
            + within[:, None] * stride_ks
            + kvh * stride_kh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if IEEE:  # noqa: SIM108 - a constexpr branch, kept explicit for the Triton compiler
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(n_mask[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache
            + phys[:, None] * stride_vb
            + within[:, None] * stride_vs
            + kvh * stride_vh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    result = acc / l_i[:, None]
    tl.store(
        out + s * stride_os + heads[:, None] * stride_oh + d[None, :],
        result.to(out.dtype.element_ty),
        mask=q_mask,
    )


def check_paged_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
) -> tuple[int, int]:
    """Shape and stride checks shared by the attention launchers; returns (group, head_dim)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)} are not [num_blocks, bs, Hkv, {head_dim}]")
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} is not [{num_seqs}, blocks]")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} is not [{num_seqs}]")
    for name, t in (
        ("query", query),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit innermost stride")
    return num_heads // num_kv_heads, head_dim


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_seqs = query.shape[0]
    group, head_dim = check_paged_inputs(query, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    grid = (num_seqs, k_cache.shape[2])
    _decode_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
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
        k_cache.shape[1],
        group,
        head_dim,
        G_PAD=max(16, triton.next_power_of_2(group)),
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=64 if head_dim <= 128 else 32,
        IEEE=k_cache.dtype == torch.float32,
    )
    return out
