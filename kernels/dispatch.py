"""Pick the implementation by device: Triton kernels for CUDA tensors, torch references otherwise.

Triton modules are imported only on first CUDA use, so CPU processes never initialise Triton (and
tests can choose TRITON_INTERPRET before the kernels are defined). Signatures are the references'.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch.nn import functional

from kvrail.kernels import reference
from kvrail.kernels.launch import pdl
from kvrail.kernels.reference import FP8_WEIGHT_DTYPE, QuantizedRows
from kvrail.kernels.shared_prefix import SharedPrefixes

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _triton(name: str) -> ModuleType:
    import importlib

    return importlib.import_module(f"kvrail.kernels.{name}")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.is_cuda:
        _triton("kv_write").write_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias. On a GPU that launches with PDL (kvrail.kernels.launch), a few rows
    (decode steps) go to the skinny split-K kernel, which, unlike cuBLAS, takes part in PDL; more
    rows, and other devices, go to torch (cuBLAS). An FP8 weight (with its `weight_scale` per
    row, and a checkpoint's static `input_scale` or None): see `_fp8_linear`; x may then come
    quantized (`takes_quantized_rows`)."""
    if weight.dtype == FP8_WEIGHT_DTYPE:
        return _fp8_linear(x, weight, bias, weight_scale, input_scale, gated=False)
    if isinstance(x, QuantizedRows):
        raise ValueError(f"quantized rows are for FP8 weights, not {weight.dtype}")
    skinny = _skinny(x)
    if skinny is not None:
        out: torch.Tensor = skinny.linear(x, weight, bias)
        return out
    return functional.linear(x, weight, bias)


def gated_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate) * up, where gate and up are the halves of x @ weight.T + bias (a SwiGLU MLP's
    fused gate/up projection). Where `linear` would take the skinny kernel, that kernel applies
    SiLU * up in its epilogue (one launch, bit for bit the same); elsewhere `linear`, then
    `silu_and_mul`."""
    if weight.dtype == FP8_WEIGHT_DTYPE:
        return _fp8_linear(x, weight, bias, weight_scale, input_scale, gated=True)
    if isinstance(x, QuantizedRows):
        raise ValueError(f"quantized rows are for FP8 weights, not {weight.dtype}")
    skinny = _skinny(x)
    if skinny is not None:
        out: torch.Tensor = skinny.gated_linear(x, weight, bias)
        return out
    return silu_and_mul(functional.linear(x, weight, bias))


def gated_linear_fp8(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    out_scale: torch.Tensor | None,
) -> QuantizedRows:
    """`gated_linear` of an FP8 weight with its output quantized for the next FP8 projection
    (with that projection's static `out_scale`, or per token), where `takes_quantized_rows`
    says that projection takes them."""
    if weight.dtype != FP8_WEIGHT_DTYPE or weight_scale is None:
        raise ValueError(f"gated_linear_fp8 takes an FP8 weight and its scale, not {weight.dtype}")
    projected = _fp8_gemm(x, weight, weight_scale, bias, input_scale)
    if projected.is_cuda:
        rows: QuantizedRows = _triton("silu_and_mul").silu_and_mul_fp8(projected, out_scale)
        return rows
    return reference.quantize_rows(reference.silu_and_mul(projected), out_scale)


def takes_quantized_rows(x: torch.Tensor | QuantizedRows, weight: torch.Tensor) -> bool:
    """Whether the projection of `x` by `weight` can multiply x's rows quantized per token (or
    with a static scale): any FP8 weight. The kernel that writes x may then write it quantized
    (`rms_norm_fp8`, `gated_linear_fp8`) instead of leaving the projection a pass over it; see
    `quantize_gated_output` for the one writer that should not at decode sizes."""
    return weight.dtype == FP8_WEIGHT_DTYPE


def quantize_gated_output(x: torch.Tensor | QuantizedRows, weight: torch.Tensor) -> bool:
    """Whether an FP8 gate/up projection of `x` should write its activation quantized for the
    FP8 projection `weight` after it (`gated_linear_fp8`). Not where the gate/up projection runs
    on the skinny kernel: its epilogue applies SiLU * up to one tile of columns, without the
    whole row a per-token scale needs, so quantizing would take another kernel; the skinny
    kernel quantizes bfloat16 rows itself, per K tile."""
    return takes_quantized_rows(x, weight) and _skinny(_values(x)) is None


def _values(x: torch.Tensor | QuantizedRows) -> torch.Tensor:
    return x.values if isinstance(x, QuantizedRows) else x


def _fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    gated: bool,
) -> torch.Tensor:
    """An e4m3 weight's projection (and with `gated`, SiLU * up of its halves). Decode-sized
    batches on a GPU with PDL take the skinny kernel, which multiplies on the FP8 tensor cores
    either x's rows as they came quantized (per token, or with a checkpoint's static
    `input_scale`: what the RMSNorms before QKV and gate/up write) or, for bfloat16 x, x
    quantized by the kernel itself per row and 128-column K tile (the output projection's and
    the down projection's inputs; a finer scale than per token, and the static
    `input_scale` unused); other CUDA
    batches quantize x per token (or with the static scale) and run cuBLASLt's FP8 GEMM
    (`kvrail.kernels.fp8_gemm`); a CPU runs the float32 reference, which quantizes x like the
    FP8 GEMM."""
    if weight_scale is None:
        raise ValueError("an FP8 weight needs its weight_scale")
    skinny = _skinny(_values(x))
    if skinny is not None:
        out: torch.Tensor = (skinny.gated_linear if gated else skinny.linear)(
            x, weight, bias, weight_scale=weight_scale
        )
        return out
    projected = _fp8_gemm(x, weight, weight_scale, bias, input_scale)
    return silu_and_mul(projected) if gated else projected


def _fp8_gemm(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """An FP8 projection past the skinny kernel: cuBLASLt's FP8 GEMM on CUDA, the float32
    reference elsewhere."""
    impl = _triton("fp8_gemm") if weight.is_cuda else reference
    out: torch.Tensor = impl.fp8_linear(x, weight, weight_scale, bias, input_scale)
    return out


def _skinny(x: torch.Tensor) -> ModuleType | None:
    """The skinny GEMM module when it should run `x`'s projection, else None."""
    if x.is_cuda and x.dim() == 2 and pdl(x.device):
        skinny = _triton("skinny_gemm")
        if x.shape[0] <= skinny.MAX_ROWS:
            return skinny
    return None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (greedy sampling): a two-pass Triton kernel for CUDA logits in 16- or
    32-bit floats (torch's reduction is slow over a 128k vocabulary), torch otherwise."""
    if x.is_cuda and x.dim() == 2 and x.dtype in _FLOATS and x.shape[1] > 0:
        out: torch.Tensor = _triton("argmax").argmax(x)
        return out
    return reference.argmax(x)


def race_scores(probs: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """A seeded draw's race scores (`reference.race_scores`): one Triton pass for CUDA float32
    probabilities, torch's dozen passes otherwise."""
    if probs.is_cuda and probs.dim() == 2 and probs.dtype == torch.float32:
        out: torch.Tensor = _triton("race").race_scores(probs, low, high)
        return out
    return reference.race_scores(probs, low, high)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Mask (to -inf, in place) the tokens a grammar forbids in the constrained rows `rows` of
    the logits (`reference.apply_token_bitmask`): one Triton pass over those rows for CUDA float
    logits, torch otherwise."""
    if logits.is_cuda and logits.dim() == 2 and logits.dtype in _FLOATS:
        _triton("token_bitmask").apply_token_bitmask(logits, bitmask, rows)
    else:
        reference.apply_token_bitmask(logits, bitmask, rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    impl = _triton("rms_norm") if x.is_cuda else reference
    out: torch.Tensor = impl.rms_norm(x, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _triton("rms_norm") if x.is_cuda else reference
    out: tuple[torch.Tensor, torch.Tensor] = impl.fused_add_rms_norm(x, residual, weight, eps)
    return out


def rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    input_scale: torch.Tensor | None,
) -> tuple[QuantizedRows, torch.Tensor | None]:
    """`rms_norm` (or with a residual, `fused_add_rms_norm`) with its output quantized for the
    FP8 projection after it (with that projection's static `input_scale`, or per token), where
    `takes_quantized_rows` says that projection takes them; returns (rows, residual)."""
    if x.is_cuda:
        norms = _triton("rms_norm")
        if residual is None:
            return norms.rms_norm_fp8(x, weight, eps, input_scale), None
        rows, summed = norms.fused_add_rms_norm_fp8(x, residual, weight, eps, input_scale)
        return rows, summed
    if residual is None:
        return reference.quantize_rows(reference.rms_norm(x, weight, eps), input_scale), None
    normed, summed = reference.fused_add_rms_norm(x, residual, weight, eps)
    return reference.quantize_rows(normed, input_scale), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    impl = _triton("silu_and_mul") if x.is_cuda else reference
    out: torch.Tensor = impl.silu_and_mul(x)
    return out


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
    impl = _triton("rotary_kv") if q.is_cuda else reference
    out: tuple[torch.Tensor, torch.Tensor] = impl.rotary_write_kv(
        positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping
    )
    return out


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
    impl = _triton("rotary_kv") if q.is_cuda else reference
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] = impl.rotary_write_kv_fp8(
        positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping
    )
    return out


def fp8_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_amax: torch.Tensor,
    num_seqs: int,
    scale: float,
    dtype: torch.dtype,
) -> QuantizedRows:
    """Causal attention of fresh sequences over e4m3 q/k/v: cuDNN's FP8 flash attention on
    CUDA (`kvrail.kernels.fp8_attention`), float32 over the same values on CPU."""
    impl = _triton("fp8_attention") if q.is_cuda else reference
    rows: QuantizedRows = impl.fp8_causal_attention(q, k, v, v_amax, num_seqs, scale, dtype)
    return rows


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
    impl = _triton("decode_attention") if query.is_cuda else reference
    out: torch.Tensor = impl.paged_decode_attention(
        query, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, prefix=prefix
    )
    return out


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
    impl = _triton("prefill_attention") if query.is_cuda else reference
    out: torch.Tensor = impl.paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        max_query_len,
        skip_fresh,
    )
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
    """Every chunk's rows as `paged_prefill_attention` computes them, over tile maps
    (`kvrail.kernels.tile_map`) on CUDA; the reference computes every chunk and ignores them."""
    if query.is_cuda:
        out: torch.Tensor = _triton("prefill_attention").tiled_prefill_attention(
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
            short_tiles, long_tiles,
        )  # fmt: skip
        return out
    return reference.paged_prefill_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
    )


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    impl = _triton("block_copy") if kv_cache.is_cuda else reference
    out: torch.Tensor = impl.gather_blocks(kv_cache, block_ids)
    return out


def scatter_blocks(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    impl = _triton("block_copy") if kv_cache.is_cuda else reference
    impl.scatter_blocks(buffer, kv_cache, block_ids)


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    impl = _triton("block_copy") if src.is_cuda else reference
    impl.copy_blocks(src, dst, src_ids, dst_ids)
