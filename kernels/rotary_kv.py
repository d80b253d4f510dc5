"""Triton kernel: rotary embedding of q and k, fused with writing k and v into their slots.

Same contract as `kvrail.kernels.reference.rotary_write_kv`: q [T, Hq, D], k/v [T, Hkv, D]
(any row and head strides, unit innermost), positions [T], cos/sin tables [max_position, D]
(float32, rotate-half layout), caches [num_blocks, block_size, Hkv, D], slot_mapping [T]
(negative slots are not written). Returns new contiguous rotated q and k; v is stored as is.
One program per token handles all its heads. Rounding follows torch's op by op in the
activation dtype (cos/sin cast first, each product rounded, then the sum), so bf16 matches.
Into an FP8 cache K and V saturate as in `kvrail.kernels.kv_write.to_cache`.

`rotary_write_kv_fp8` is the same pass for attention in FP8 (`kvrail.kernels.fp8_attention`):
rotated q and k, and v, come back contiguous in the FP8 cache's dtype, each value as the cache
holds it (a scale of 1, saturated), with the largest magnitude of v's values (float32 [1]).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvrail.kernels.kv_write import fp8_limit, to_cache
from kvrail.kernels.launch import pdl
from kvrail.kernels.reference import FP8_DTYPES


@triton.jit
def _rotate(base, head_stride, num_heads, head_dim, c, s, d, partner, sign, H_PAD: tl.constexpr):
    """Rotate the [H_PAD, D_PAD] heads at `base`; returns them with their head index and mask."""
    h = tl.arange(0, H_PAD)[:, None]
    mask = (h < num_heads) & (d[None, :] < head_dim)
    x = tl.load(base + h * head_stride + d[None, :], mask=mask, other=0.0)
    other = tl.load(base + h * head_stride + partner[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    a = (x.to(tl.float32) * c[None, :]).to(dtype).to(tl.float32)
    b = ((sign[None, :] * other.to(tl.float32)) * s[None, :]).to(dtype).to(tl.float32)
    return (a + b).to(dtype), h, mask


@triton.jit
def _rotary_kv_kernel(
    q,
    k,
    v,
    positions,
    cos,
    sin,
    q_out,
    k_out,
    v_out,
    v_amax,
    k_cache,
    v_cache,
    slot_mapping,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    num_heads,
    num_kv_heads,
    head_dim,
    D_PAD: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    LIMIT: tl.constexpr,
    PDL: tl.constexpr,
    FP8_OUT: tl.constexpr,
):
    if PDL:  # see kvrail.kernels.launch
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    half = head_dim // 2
    d = tl.arange(0, D_PAD)
    d_mask = d < head_dim
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    dtype = q.dtype.element_ty
    c = tl.load(cos + pos * stride_cos + d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin + pos * stride_cos + d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    qr, hq, q_mask = _rotate(
        q + t * stride_qt, stride_qh, num_heads, head_dim, c, s, d, partner, sign, HQ_PAD
    )
    if FP8_OUT:
        qr = to_cache(qr, q_out, LIMIT)
    tl.store(q_out + (t * num_heads + hq) * head_dim + d[None, :], qr, mask=q_mask)
    kr, hk, k_mask = _rotate(
        k + t * stride_kt, stride_kh, num_kv_heads, head_dim, c, s, d, partner, sign, HKV_PAD
    )
    k_dst = k_out + (t * num_kv_heads + hk) * head_dim + d[None, :]
    if FP8_OUT:
        tl.store(k_dst, to_cache(kr, k_out, LIMIT), mask=k_mask)
    else:
        tl.store(k_dst, kr, mask=k_mask)
    # v and the slot are loaded up front and the stores masked, rather than branching on the
    # slot: a branch would wait for the slot before it even asked for v
    val = tl.load(v + t * stride_vt + hk * stride_vh + d[None, :], mask=k_mask, other=0.0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    write = k_mask & ((hk * 0 + slot) >= 0)  # a tensor mask (a scalar one is not accepted)
    slot = tl.maximum(slot, 0)  # in bounds even where nothing is written
    blk = slot // block_size
    off = slot % block_size
    kc = k_cache + blk * stride_cb + off * stride_cs + hk * stride_ch + d[None, :]
    tl.store(kc, to_cache(kr, k_cache, LIMIT), mask=write)
    vc = v_cache + blk * stride_vcb + off * stride_vcs + hk * stride_vch + d[None, :]
    tl.store(vc, to_cache(val, v_cache, LIMIT), mask=write)
    if FP8_OUT:
        v8 = to_cache(val, v_out, LIMIT)
        tl.store(v_out + (t * num_kv_heads + hk) * head_dim + d[None, :], v8, mask=k_mask)
        tl.atomic_max(v_amax, tl.max(tl.max(tl.abs(v8.to(tl.float32)), axis=1), axis=0))


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
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_out, k_out, None, None)
    return q_out, k_out


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
    """As `rotary_write_kv` into an FP8 cache -> (q, k, v in its dtype, v's largest magnitude)."""
    if k_cache.dtype not in FP8_DTYPES:
        raise ValueError(f"FP8 outputs need an FP8 cache, not {k_cache.dtype}")
    q_out = torch.empty(q.shape, dtype=k_cache.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k_cache.dtype, device=k.device)
    v_out = torch.empty(v.shape, dtype=k_cache.dtype, device=v.device)
    v_amax = torch.zeros(1, dtype=torch.float32, device=v.device)
    _launch(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_out, k_out, v_out,
            v_amax)  # fmt: skip
    return q_out, k_out, v_out, v_amax


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor | None,
    v_amax: torch.Tensor | None,
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even (rotate-half pairs)")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos/sin {tuple(cos.shape)} are not [max_position, {head_dim}]")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold [*, *, Hkv, {head_dim}]")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions/slot_mapping are not [{num_tokens}]")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("cache", k_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit innermost stride")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache {v_cache.dtype}")
    if v_cache.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("v_cache needs a unit innermost stride; cos and sin the same strides")
    if num_tokens == 0:
        return
    on = pdl(q.device)
    _rotary_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos,
        sin,
        q_out,
        k_out,
        q_out if v_out is None else v_out,
        q_out if v_amax is None else v_amax,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        num_heads,
        num_kv_heads,
        head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        HQ_PAD=triton.next_power_of_2(num_heads),
        HKV_PAD=triton.next_power_of_2(num_kv_heads),
        LIMIT=fp8_limit(k_cache),
        PDL=on,
        FP8_OUT=v_out is not None,
        launch_pdl=on,
    )
