"""What both paged attention kernels share: loading a tile of K or V through the block table
(`paged_load`, then `paged_convert`), an FP8 cache read as int32 words of four values and
converted to float16 in registers (`words_fit` says where the layout allows it), and on the host
the launchers' shape and stride checks (`check_paged_inputs`) and the dtype they multiply in
(`compute_dtype`). Why words and float16: `kvrail.kernels.decode_attention`'s docstring, with
the measurements.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrail.kernels.reference import FP8_DTYPES


@triton.jit
def _fp8_words_to_f16(words, E5M2: tl.constexpr):
    """int32 words of four FP8 values each -> the four values in float16 (exact), as four
    tensors of the words' shape (element 4i + j of a row in the j-th)."""
    cvt: tl.constexpr = "cvt.rn.f16x2.e5m2x2" if E5M2 else "cvt.rn.f16x2.e4m3x2"
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; "
        + cvt
        + " x, lo; "
        + cvt
        + " y, hi; mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
        constraints="=h,=h,=h,=h,r",
        args=[words],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _fp8_words(cache, rows, n_mask, D_PAD: tl.constexpr):
    """The int32 words of a [len(rows), D_PAD] tile of an FP8 cache: token i's head row starts
    at word `rows[i]` of `cache` read as int32 words (`_fp8_convert` makes them float16)."""
    w = tl.arange(0, D_PAD // 4)
    return tl.load(
        cache.to(tl.pointer_type(tl.int32), bitcast=True) + rows[:, None] + w[None, :],
        mask=n_mask[:, None],
        other=0,
    )


@triton.jit
def _fp8_convert(words, E5M2: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr):
    """`_fp8_words`'s words as the [BLOCK_N, D_PAD] float16 tile, converted in registers, so the
    tile reaches shared memory (on its way to the dot) already 16-bit, not as bytes that a
    transposed operand would read one at a time."""
    a, b, c, d = _fp8_words_to_f16(words, E5M2)
    quads = tl.join(tl.join(a, c), tl.join(b, d))  # [.., w, 2, 2]: a, b, c, d in order
    return tl.reshape(quads, [BLOCK_N, D_PAD])


@triton.jit
def paged_load(
    cache,
    phys,
    within,
    kvh,
    stride_b,
    stride_s,
    stride_h,
    d,
    n_mask,
    d_mask,
    WORDS: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """KV head `kvh`'s rows at tokens in blocks `phys`, offsets `within`, as loaded: the tile as
    stored or, with WORDS (an FP8 cache, strides counted in int32 words), its words;
    `paged_convert` gives the tile the dots take. Both attention kernels load K and V so (the
    prefill kernel as stored)."""
    if WORDS:  # a constexpr branch: one return, the two differ in type and shape
        raw = _fp8_words(cache, phys * stride_b + within * stride_s + kvh * stride_h, n_mask,
                         D_PAD)  # fmt: skip
    else:
        raw = tl.load(
            cache
            + phys[:, None] * stride_b
            + within[:, None] * stride_s
            + kvh * stride_h
            + d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
    return raw


@triton.jit
def paged_convert(raw, cache, WORDS: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr):
    """`paged_load`'s result as the [BLOCK_N, D_PAD] tile: WORDS in float16, else as it is."""
    if WORDS:
        tile = _fp8_convert(raw, cache.dtype.element_ty == tl.float8e5, BLOCK_N, D_PAD)
    else:
        tile = raw
    return tile


F16_MAX = tl.constexpr(float(torch.finfo(torch.float16).max))


@triton.jit
def decode_query(q, k_cache, scale, KV_FP8: tl.constexpr):
    """Query rows as the decode kernels' dots take them: in the cache's dtype, or over an FP8
    cache in float16 with the scale folded in, saturating, not inf (see
    `kvrail.kernels.decode_attention`'s docstring)."""
    if not KV_FP8:
        q = q.to(k_cache.dtype.element_ty)
    else:
        q = tl.clamp(q.to(tl.float32) * scale, -F16_MAX, F16_MAX).to(tl.float16)
    return q


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache,
    v_cache,
    table,
    start,
    hi,
    scale,
    kvh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    block_size,
    d,
    d_mask,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_WORDS: tl.constexpr,
):
    """One BLOCK_N-token tile from `start` (tokens from `hi` on masked) of the block table `table`
    folded into the online softmax of the query rows `q` (KV head `kvh`): the new (max, sum,
    unnormalised acc). Every decode kernel's loop body (`kvrail.kernels.prefix_attention`'s too)."""
    n = start + tl.arange(0, BLOCK_N)
    n_mask = n < hi
    phys = tl.load(table + n // block_size, mask=n_mask, other=0).to(tl.int64)
    within = (n % block_size).to(tl.int64)
    k_raw = paged_load(k_cache, phys, within, kvh, stride_kb, stride_ks, stride_kh, d, n_mask,
                       d_mask, KV_WORDS, D_PAD)  # fmt: skip
    # V's load issued with K's, both in flight before the first dot waits, except for an FP8
    # cache read as bytes (slower there: see kvrail.kernels.decode_attention's docstring)
    if KV_WORDS or not KV_FP8:
        v_raw = paged_load(v_cache, phys, within, kvh, stride_vb, stride_vs, stride_vh, d,
                           n_mask, d_mask, KV_WORDS, D_PAD)  # fmt: skip
    k = paged_convert(k_raw, k_cache, KV_WORDS, BLOCK_N, D_PAD)
    if KV_FP8:  # read in FP8, multiplied in float16 (already, read as words)
        k = k.to(tl.float16)
    if IEEE:  # noqa: SIM108 - a constexpr branch, kept explicit for the Triton compiler
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    if not KV_FP8:
        scores = scores * scale
    scores = tl.where(n_mask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_FP8 and not KV_WORDS:  # not loaded above
        v_raw = paged_load(v_cache, phys, within, kvh, stride_vb, stride_vs, stride_vh, d,
                           n_mask, d_mask, KV_WORDS, D_PAD)  # fmt: skip
    v = paged_convert(v_raw, v_cache, KV_WORDS, BLOCK_N, D_PAD)
    if KV_FP8:
        v = v.to(tl.float16)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


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
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache {v_cache.dtype}")
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


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor, words: bool) -> tuple[int, ...]:
    """K's and V's block, token and head strides as the decode kernels take them: in int32
    words when they read an FP8 cache as words (`words_fit`), else in elements."""
    unit = 4 if words else 1
    return tuple(t.stride(i) // unit for t in (k_cache, v_cache) for i in range(3))


def compute_dtype(query: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The dtype the attention kernels multiply in: the cache's, except that an FP8 cache is
    read in FP8 and converted, by the prefill kernel to the query's dtype and by the decode
    kernel to float16 (see `kvrail.kernels.decode_attention`); never FP8 dots, which would lose the
    query's precision."""
    return query.dtype if k_cache.dtype in FP8_DTYPES else k_cache.dtype


def words_fit(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether an FP8 cache can be read as int32 words of four values (`_fp8_words`): every
    head row whole words on a 16-byte boundary, and the head dimension a power of two of at
    least 16 (no column mask)."""
    if k_cache.dtype not in FP8_DTYPES or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    return all(
        t.data_ptr() % 16 == 0 and all(stride % 16 == 0 for stride in t.stride()[:3])
        for t in (k_cache, v_cache)
    )
