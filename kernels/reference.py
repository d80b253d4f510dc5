"""Pure-torch references of every kernel: the CPU path and the oracle of the Triton tests.

Shapes (T tokens, S sequences, Hq query heads, Hkv KV heads, D head dim, B blocks per table):
- a per-layer cache `k_cache` / `v_cache` is [num_blocks, block_size, Hkv, D] with any strides
  (the worker's views into its single KV region are not contiguous across blocks);
- `slot_mapping` [T] int: slot = block_id * block_size + offset; a negative slot is skipped;
- `block_tables` [S, B] int: block ids per sequence, padded with anything (0, the null block);
- `seq_lens` [S] int: tokens of context per sequence, including the ones being computed;
- `query_start_loc` [S + 1] int: cumulative query lengths (the prefill queries are packed).

Attention is causal over positions: query i of a sequence with q_len queries and seq_len context
sits at position seq_len - q_len + i and sees keys 0..that position. Grouped-query attention maps
query head h to KV head h // (Hq // Hkv). Scores and softmax are computed in float32, from a cache
of any float dtype, FP8 included (written by `write_kv` with a scale of 1). No function
here mutates its inputs except the destination cache of `write_kv` and `scatter_blocks`, and
the logits `apply_token_bitmask` masks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvrail.kernels.shared_prefix import SharedPrefixes, check_shared_prefixes

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [T, Hkv, D] into their slots of the paged caches."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache_dtype(key[valid], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype(value[valid], v_cache.dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to a cache's dtype; into FP8 (a scale of 1), values beyond its largest finite
    value saturate there (a plain cast may give NaN) and NaN stays NaN."""
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        x = x.float().clamp(-limit, limit)
    return x.to(dtype)


FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_WEIGHT_DTYPE).max)  # 448
FP8_MIN_SCALE = 1e-12  # an all-zero row or token: its values stay 0
FP8_ATTENTION_RANGE = 256.0
"""The largest magnitude FP8 attention gives its probabilities (over [0, 1]) and its output rows
(over the largest |v|): a power of two below e4m3's 448, so that P rounded up (by up to 1/16)
and an output row computed from it stay in range (e4m3 has no infinity: beyond 448 is NaN
unless saturated). cuDNN's own FP8 attention tests leave more room still."""


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] as e4m3 values with one float32 scale per row [out]: the row's
    largest magnitude over 448, so that the row's largest value maps to the format's largest."""
    wf = weight.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return to_cache_dtype(wf / scale[:, None], FP8_WEIGHT_DTYPE), scale


class QuantizedRows(NamedTuple):
    """Activations [T, K] quantized for an FP8 projection, as `quantize_rows` (or a kernel that
    quantizes what it writes: `kvrail.kernels.dispatch.takes_quantized_rows`) leaves them: e4m3
    `values`, the float32 `scales` [T] they were divided by, and the activations' own `dtype`,
    which the projection's output takes."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> QuantizedRows:
    """x [.., K] in e4m3 over a dynamic scale per token (its largest magnitude over 448, at
    least FP8_MIN_SCALE), or over `input_scale` (a checkpoint's static scale) on every row."""
    xf = x.float()
    if input_scale is None:
        scales = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    else:
        scales = input_scale.float().reshape(()).expand(xf.shape[:-1])
    return QuantizedRows(to_cache_dtype(xf / scales[..., None], FP8_WEIGHT_DTYPE), scales, x.dtype)


def dequantize_rows(rows: QuantizedRows) -> torch.Tensor:
    """The activations that `rows` quantized, back in their dtype."""
    return (rows.values.float() * rows.scales[:, None]).to(rows.dtype)


def fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [.., in] @ (weight [out, in] in e4m3 * weight_scale [out]).T + bias, as an FP8 GEMM
    computes it: x is quantized to e4m3 too (`quantize_rows`, unless it comes quantized), the
    two FP8 operands are multiplied and summed in float32, scaled, cast back to x's dtype, and
    the bias added."""
    rows = x if isinstance(x, QuantizedRows) else quantize_rows(x, input_scale)
    scales = rows.scales[..., None] * weight_scale
    out = ((rows.values.float() @ weight.float().T) * scales).to(rows.dtype)
    return out if bias is None else out + bias


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, Hq, D], k/v [L, Hkv, D], causal with the queries at the last Q positions."""
    num_q, num_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf = q.float().reshape(num_q, num_kv_heads, group, head_dim)
    scores = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale
    q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.reshape(num_q, num_heads, head_dim).to(q.dtype)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    prefix: SharedPrefixes | None = None,
) -> torch.Tensor:
    """One query token per sequence: query [S, Hq, D] -> [S, Hq, D]. `num_splits` (how many
    programs share one sequence's context in the kernel) and `prefix` (rows that share their
    first blocks) are launch hints the reference does not need; `prefix` is checked."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if prefix is not None:
        check_shared_prefixes(prefix, block_tables, seq_lens, block_size)
    if num_seqs == 0:
        return query.new_empty(query.shape)
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks].long()
    keys = k_cache[tables].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].float()
    values = v_cache[tables].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len].float()
    q = query.float().reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("shgd,skhd->shgk", q, keys) * scale
    positions = torch.arange(max_len, device=query.device)
    mask = positions.unsqueeze(0) >= seq_lens.to(query.device).unsqueeze(1)
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    out = torch.einsum("shgk,skhd->shgd", scores.softmax(dim=-1), values)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


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
    """Packed queries [T, Hq, D] over each sequence's paged context (which already holds the
    queries' own KV) -> [T, Hq, D]. `max_query_len` is a sizing hint the reference ignores. With
    `skip_fresh`, rows of chunks whose query is their whole context (no prefix) are left
    unwritten: the caller computes those itself."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start or (skip_fresh and end - start == seq_len):
            continue
        k = _gather_context(k_cache, block_tables[i], seq_len)
        v = _gather_context(v_cache, block_tables[i], seq_len)
        out[start:end] = _attend(query[start:end], k, v, scale)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, H] in float32, cast back, times the weight (transformers' order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x). The kernel updates `residual` in place and returns
    it; callers use the returned residual and treat the input one as consumed."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [rows, vocab] -> int64 [rows]: the first index of each row's maximum (NaN counts as
    the maximum)."""
    return x.argmax(dim=-1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: row `rows[i]` of logits [n, vocab] keeps the tokens whose bit is set in
    bitmask [m, words] int32 row i (bit t % 32 of word t // 32, llguidance's layout) and gets
    -inf for the others, a token past 32 * words included; other rows are untouched. Bits are
    read through little-endian bytes and a table of each byte's eight."""
    num_rows, words = bitmask.shape
    if num_rows == 0:
        return
    cols = logits.shape[1]
    shifts = torch.arange(8, device=bitmask.device)
    table = (torch.arange(256, device=bitmask.device).unsqueeze(1) >> shifts) & 1 == 1
    allowed = table[bitmask.contiguous().view(torch.uint8).long()].reshape(num_rows, 32 * words)
    if allowed.shape[1] < cols:
        allowed = torch.nn.functional.pad(allowed, (0, cols - allowed.shape[1]))
    kept = logits.index_select(0, rows).masked_fill(~allowed[:, :cols], float("-inf"))
    logits.index_copy_(0, rows, kept)


_MASK_32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """`x * constant` mod 2**32 for int64 `x` in [0, 2**32), in two products that never
    overflow int64 (a 32 x 32-bit product could)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK_32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xor-shift-multiply, two rounds) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def race_scores(probs: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] float32, each row's 64-bit key as int64 halves low, high [rows] (in
    [0, 2**32)) -> float32 [rows, vocab]: p / E per token, E = -log(u) an Exp(1) variable, u
    made of 23 bits of a hash of the token id and the key (in (0, 1): float32 states every such
    u exactly, so none rounds to 1 and gives E = 0). The argmax of a row picks token i with
    probability p_i (an exponential race), as a pure function of the key."""
    ids = torch.arange(probs.shape[1], device=probs.device, dtype=torch.int64).unsqueeze(0)
    bits = _hash32(_hash32(ids ^ low.unsqueeze(1)) ^ high.unsqueeze(1))
    return probs / -torch.log(race_uniform(bits))


def race_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64) -> float32 uniforms in (0, 1): the top 23 bits, plus a half. Every
    value is exact in float32, so none rounds to 1 (24 bits would: 2**24 - 0.5 is not a float32)."""
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their positions [T] (rotate-half, cos/sin tables
    [max_position, D] cast to q's dtype), store the rotated k and v into their slots, and return
    the rotated (q, k) as new tensors."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    q_rot = q * c + _rotate_half(q) * s
    k_rot = k * c + _rotate_half(k) * s
    write_kv(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot, k_rot


def rotary_write_kv_fp8(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rotary_write_kv` into an FP8 cache, whose (q, k) and v come back in the cache's dtype
    as it holds them, with v's largest magnitude there (float32 [1])."""
    if k_cache.dtype not in FP8_DTYPES:
        raise ValueError(f"FP8 outputs need an FP8 cache, not {k_cache.dtype}")
    q_rot, k_rot = rotary_write_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    q8, k8, v8 = (to_cache_dtype(x, k_cache.dtype) for x in (q_rot, k_rot, v))
    v_amax = v8.float().abs().amax().reshape(1) if v8.numel() else v8.new_zeros(1).float()
    return q8, k8, v8, v_amax


def fp8_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_amax: torch.Tensor,
    num_seqs: int,
    scale: float,
    dtype: torch.dtype,
) -> QuantizedRows:
    """`kvrail.kernels.fp8_attention.fp8_causal_attention`'s contract, in float32: `num_seqs`
    equal-length sequences packed in e4m3 q [n*L, Hq, D], k/v [n*L, Hkv, D], each attending
    causally to itself; the output's rows [n*L, Hq*D] in e4m3 over FP8_ATTENTION_RANGE / v_amax
    (every row a convex combination of rows of v), with that scale's inverse for every row."""
    total, num_heads, head_dim = q.shape
    if num_seqs < 1 or total % num_seqs:
        raise ValueError(f"{total} tokens are not {num_seqs} sequences of one length")
    length = total // num_seqs

    def heads(x: torch.Tensor) -> torch.Tensor:  # [n, H, L, D] in float32
        return x.float().reshape(num_seqs, length, x.shape[1], head_dim).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(
        heads(q), heads(k), heads(v), is_causal=True, scale=scale,
        enable_gqa=k.shape[1] != num_heads,
    )  # fmt: skip
    amax = v_amax.float().reshape(()).clamp(min=1e-6)
    rows = out.transpose(1, 2).reshape(total, num_heads * head_dim) * (FP8_ATTENTION_RANGE / amax)
    values = to_cache_dtype(rows, FP8_WEIGHT_DTYPE)
    return QuantizedRows(values, (amax / FP8_ATTENTION_RANGE).expand(total).contiguous(), dtype)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Pack the given blocks of a [num_blocks, ...] cache into a new contiguous [n, ...] buffer."""
    return kv_cache[block_ids.long()].contiguous()


def scatter_blocks(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write a packed [n, ...] buffer back into the given blocks of the cache."""
    kv_cache[block_ids.long()] = buffer.to(kv_cache.dtype)


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for every i where neither id is negative (padding:
    skipped); block ids index dim 0 of both."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError("source and destination blocks differ in size or dtype")
    if src_ids.shape != dst_ids.shape:
        raise ValueError(f"{src_ids.shape[0]} source ids but {dst_ids.shape[0]} destination ids")
    keep = (src_ids >= 0) & (dst_ids >= 0)
    dst[dst_ids[keep].long()] = src[src_ids[keep].long()]
