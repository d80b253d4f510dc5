"""Triton kernel: paged decode attention, one query token per sequence, split-K (flash-decoding).

Same contract as `kvrail.kernels.reference.paged_decode_attention`. The grid is (KV head,
sequence, split), the KV head fastest, so the programs that run together read the same blocks'
token rows (one block holds every head's row of a token side by side): each program takes all
the query heads of its KV head's group (K and V are loaded once per group) over one contiguous
slice of the context, walking it in BLOCK_N-token tiles through the block table with an online
softmax (float32 accumulators). With one split the program normalises and stores the output
directly; with several, each writes its partial (max, sum, unnormalised acc) and
`_reduce_kernel` merges the splits in a fixed order, so results are deterministic. The split
count is chosen on the host from the batch and a static context bound (the block table's width),
never from `seq_lens`, so a launch is CUDA-graph capturable; a slice's length is derived from
the sequence's own length inside the kernel. With a `SharedPrefixes` hint, rows that share their
first blocks have them attended once per group (`kvrail.kernels.prefix_attention`, partial slot
0); this kernel then splits only each row's tokens past them, into the slots after (SLOT0).
An FP8 cache is read as stored (half the bytes of bf16) and each tile converted to float16, which
holds every e4m3 and e5m2 value exactly, for dots with a float16 query that carries the softmax
scale (so the scores need no multiply; a query beyond float16's range saturates). Converting to
float16 is cheaper than to bf16 and keeps three more bits of the query: at 256 sequences of 512-640
tokens one layer took 177 us against 195 (bench/studies/attention/decode_attention_sweep.txt, which
also tried an e4m3 query against e4m3 K: 185 us at ten times the error). Where the layout allows
(`words_fit`: the engine's always does), the tiles are loaded as int32 words of four values and
converted in registers (`paged_kv`), so they reach shared memory, on their way to the dots, already
16-bit: loaded as bytes, the compiler converts them after shared memory, and V, which the second dot
takes transposed, was read from there a byte at a time (256 sequences: 156.8 against 177.8 us a
layer). V's tile is loaded together with K's, so both are in flight before the first dot waits,
except for an FP8 cache read as bytes, where that was slower. On an H100, the grid's order and V's
early load together took 256 sequences' FP8 layer from 138.9-139.0 to 136.2-136.6 us and bf16's from
214.0 to 211.1-211.2 (the grid order alone: 138.5-138.9 and 211.5-211.6); loading the next tile's K
and V while one tile is multiplied was much slower (181 and 256 us:
bench/studies/attention/decode_attention_sweep.txt).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvrail.kernels import prefix_attention
from kvrail.kernels.launch import pdl
from kvrail.kernels.paged_kv import (
    attend_tile,
    cache_strides,
    check_paged_inputs,
    compute_dtype,
    decode_query,
    words_fit,
)
from kvrail.kernels.reference import FP8_DTYPES
from kvrail.kernels.shared_prefix import SharedPrefixes

MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 32
WAVES = 2  # aim for about this many programs per SM before splitting stops


# The table width varies from step to step in eager steps: not specialized on, so it never
# compiles another variant while serving (see kvrail.worker.engine.cuda_graph).
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_kernel(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    starts,
    out,
    part_ml,
    part_acc,
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
    num_heads,
    num_splits,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_WORDS: tl.constexpr,
    SLOT0: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # see kvrail.kernels.launch; the next kernel is let in after the main loop
        gdc_wait()
    kvh = tl.program_id(0)  # fastest: a sequence's KV heads share its blocks' rows
    s = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + s)
    first = 0
    if SLOT0:  # slot 0 is the shared prefix's (kvrail.kernels.prefix_attention): skip its tokens
        first = tl.load(starts + s)
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    d_mask = d < head_dim
    g_mask = g < group
    q_mask = g_mask[:, None] & d_mask[None, :]
    heads = kvh * group + g
    q = tl.load(
        query + s * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    q = decode_query(q, k_cache, scale, KV_FP8)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = block_tables + s.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_cache, v_cache, table, start, hi, scale,
                                    kvh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                    stride_vh, block_size, d, d_mask, BLOCK_N, D_PAD, IEEE,
                                    KV_FP8, KV_WORDS)  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    if DIRECT:
        tl.store(
            out + s * stride_os + heads[:, None] * stride_oh + d[None, :],
            (acc / l_i[:, None]).to(out.dtype.element_ty),
            mask=q_mask,
        )
    else:
        # partials: part_ml [S, Hq, 2, slots] (max, sum), part_acc [S, Hq, slots, D_PAD], the
        # splits from slot SLOT0 on
        row = s.to(tl.int64) * num_heads + heads
        slots = num_splits + SLOT0
        slot = split + SLOT0
        tl.store(part_ml + (row * 2) * slots + slot, m_i, mask=g_mask)
        tl.store(part_ml + (row * 2 + 1) * slots + slot, l_i, mask=g_mask)
        acc_ptr = part_acc + ((row * slots + slot) * D_PAD)[:, None] + d[None, :]
        tl.store(acc_ptr, acc, mask=g_mask[:, None])


@triton.jit
def _reduce_kernel(
    part_ml,
    part_acc,
    starts,
    out,
    stride_os,
    stride_oh,
    head_dim,
    num_heads,
    num_splits,
    SPLIT_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    SLOT0: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merges a row's slots (`num_splits` of them: with SLOT0, the shared prefix's slot 0, which
    holds nothing for a row whose start is 0, then the splits of the rest)."""
    if PDL:  # see kvrail.kernels.launch
        gdc_wait()
        gdc_launch_dependents()
    s = tl.program_id(0)
    h = tl.program_id(1)
    row = s.to(tl.int64) * num_heads + h
    i = tl.arange(0, SPLIT_PAD)
    d = tl.arange(0, D_PAD)
    i_mask = i < num_splits
    if SLOT0:  # a row without a shared prefix: its slot 0 was never written
        i_mask = i_mask & (i >= tl.where(tl.load(starts + s) > 0, 0, 1))
    m = tl.load(part_ml + (row * 2) * num_splits + i, mask=i_mask, other=float("-inf"))
    l_s = tl.load(part_ml + (row * 2 + 1) * num_splits + i, mask=i_mask, other=0.0)
    acc = tl.load(
        part_acc + (row * num_splits + i)[:, None] * D_PAD + d[None, :],
        mask=i_mask[:, None],
        other=0.0,
    )
    m_max = tl.max(m, 0)  # finite: the first split always holds at least one token
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    total = tl.sum(w * l_s, 0)
    result = tl.sum(w[:, None] * acc, 0) / total
    tl.store(
        out + s * stride_os + h * stride_oh + d, result.to(out.dtype.element_ty), mask=d < head_dim
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per (sequence, KV head) so the grid holds about WAVES programs per SM, each with at
    least MIN_SPLIT_TOKENS of the longest possible context; 1 when the batch alone gives every SM
    a program (splitting then costs more in the reduce pass than it balances: at 32 sequences of
    8 KV heads one split of 128-token tiles took 26.0 us against 27.5 for two plus the reduce,
    bench/studies/attention/decode_attention_sweep.txt)."""
    base = max(1, num_seqs * num_kv_heads)
    if base >= num_sms:
        return 1
    wanted = triton.cdiv(WAVES * num_sms, base)
    return max(1, min(MAX_SPLITS, int(wanted), int(triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS))))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
    fp8_words: bool | None = None,
    prefix: SharedPrefixes | None = None,
) -> torch.Tensor:
    """`num_splits` None picks it from the batch and the table's width (a static bound on the
    context, so no host sync and the same choice on every replay of a captured graph). `prefix`:
    rows that share their first blocks, which `kvrail.kernels.prefix_attention` attends once per
    group; the rest of each row is split as usual, and the reduce merges both (launch hint: the
    result is the same without it).
    `block_n`, `num_warps`, `num_stages`, `max_registers` (a cap on registers per thread, which
    can fit more programs on an SM at the cost of spills; at 96 and 80 slower than the default
    at 256 sequences on an H100, decode_attention_sweep.txt): tuning knobs (None: the defaults;
    see bench/studies/attention/decode_attention_sweep.py and kernel_sass.py). `fp8_words`: read an
    FP8 cache as int32 words (None: wherever its strides and alignment allow, `words_fit`; False: as
    bytes)."""
    num_seqs = query.shape[0]
    group, head_dim = check_paged_inputs(query, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    num_sms = _num_sms(query.device.index or 0) if query.is_cuda else 4
    if num_splits is None:
        max_seq_len = block_tables.shape[1] * k_cache.shape[1]
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if max_registers is not None and not 24 <= max_registers <= 255:
        raise ValueError(f"max_registers must be within 24..255, got {max_registers}")
    d_pad = max(16, triton.next_power_of_2(head_dim))
    slot0 = int(prefix is not None)  # partials: the prefix's slot 0, then the splits
    slots = num_splits + slot0
    starts = seq_lens if prefix is None else prefix.starts  # read only with a prefix
    direct = slots == 1
    on = pdl(query.device)
    fits = words_fit(k_cache, v_cache, head_dim)
    words = fits if fp8_words is None else fp8_words
    if words and not fits:
        raise ValueError("this cache cannot be read as int32 words (see words_fit)")
    tile, warps, stages = (64 if head_dim <= 128 else 32), 4, 3
    if k_cache.dtype in FP8_DTYPES:  # an FP8 cache's best at 256 sequences: as bytes 177
        # against 185 us, as words 133.9 against 156.1 (decode_attention_sweep.txt); split
        # contexts (batch 1) keep 32-token tiles, 5.5 against 5.8 us
        tile, warps, stages = (64 if words and direct else 32), 4, 2
    if direct and head_dim <= 128 and num_seqs * num_kv_heads < 2 * num_sms:
        tile, warps, stages = 128, 8, 2  # few long programs: larger tiles (batch 32's best)
    part_ml = part_acc = out  # unused placeholders when the kernel stores directly
    if not direct:
        f32 = torch.float32
        part_ml = torch.empty(num_seqs, num_heads, 2, slots, dtype=f32, device=query.device)
        part_acc = torch.empty(num_seqs, num_heads, slots, d_pad, dtype=f32, device=query.device)
    ieee = compute_dtype(query, k_cache) == torch.float32
    if prefix is not None:
        prefix_attention.launch(query, k_cache, v_cache, block_tables, prefix, part_ml, part_acc,
                                scale, words, ieee)  # fmt: skip
    _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        starts,
        out,
        part_ml,
        part_acc,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *cache_strides(k_cache, v_cache, words),
        block_tables.stride(0),
        k_cache.shape[1],
        group,
        head_dim,
        num_heads,
        num_splits,
        G_PAD=max(16, triton.next_power_of_2(group)),
        D_PAD=d_pad,
        BLOCK_N=block_n or tile,
        DIRECT=direct,
        IEEE=ieee,
        KV_FP8=k_cache.dtype in FP8_DTYPES,
        KV_WORDS=words,
        SLOT0=slot0,
        PDL=on,
        launch_pdl=on,
        num_warps=num_warps or warps,
        num_stages=num_stages or stages,
        **({} if max_registers is None else {"maxnreg": max_registers}),
    )
    if not direct:
        _reduce_kernel[(num_seqs, num_heads)](
            part_ml,
            part_acc,
            starts,
            out,
            out.stride(0),
            out.stride(1),
            head_dim,
            num_heads,
            slots,
            SPLIT_PAD=triton.next_power_of_2(slots),
            D_PAD=d_pad,
            SLOT0=slot0,
            PDL=on,
            launch_pdl=on,
        )
    return out
