"""The FP8 paths of the Triton kernels against the torch references, on a GPU.

FP8 KV cache: the KV write (plain and fused with rotary) stores exactly the reference's bytes
(saturating, NaN kept), attention over an FP8 cache matches the reference reading the same bytes,
and block copies move FP8 blocks unchanged. FP8 weights: per-token activation quantization, the
FP8 GEMM of prefill-sized batches (activations and weights in e4m3) against the reference that
quantizes the same way, and the skinny kernel's weight-only FP8 (x kept in bfloat16) against the
product of x and the dequantized weight; an engine with FP8 weights and an FP8 cache replays its
CUDA graphs token for token like its eager steps.

These run only where CUDA is: Triton's CPU interpreter converts to and from FP8 wrongly (bfloat16
values of magnitude 100 stored into e4m3 come back as +-448), so an interpreted run would test
the interpreter, not the kernels.
"""

from __future__ import annotations

import pytest
import torch

from kvrail.kernels import dispatch, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA: Triton's interpreter does not convert FP8 faithfully",
    ),
]

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
BF16 = torch.bfloat16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to("cuda", BF16)


def _caches(num_blocks: int, bs: int, hkv: int, d: int, dtype: torch.dtype, g: torch.Generator):
    region = torch.randn(num_blocks, 2, 2, bs, hkv, d, generator=g).clamp(-8, 8)
    region = region.to(dtype).to("cuda")
    return region, region[:, 1, 0], region[:, 1, 1]


def _tables(seq_lens: list[int], bs: int, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    width = max(-(-s // bs) for s in seq_lens) + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    return perm[: len(seq_lens) * width].reshape(len(seq_lens), width).to("cuda", torch.int32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_kv_write_stores_the_references_fp8_bytes_saturating_and_keeping_nan(dtype) -> None:
    from kvrail.kernels import kv_write

    g = _gen(1)
    key = _randn(9, 2, 64, g=g, scale=300.0)  # beyond e4m3's 448 in places
    value = _randn(9, 2, 64, g=g, scale=3.0)
    key[0, 0, 0], key[1, 1, 5], value[2, 0, 7] = 1e5, -1e5, float("nan")
    slots = torch.tensor([3, 17, -1, 0, 40, 41, 42, 5, 63], dtype=torch.int64, device="cuda")
    _, k_cache, v_cache = _caches(16, 4, 2, 64, dtype, g)
    ek, ev = k_cache.clone(), v_cache.clone()
    kv_write.write_kv(key, value, k_cache, v_cache, slots)
    reference.write_kv(key, value, ek, ev, slots)
    assert torch.equal(_bytes(k_cache), _bytes(ek))
    assert torch.equal(_bytes(v_cache), _bytes(ev))
    assert k_cache.float().abs().max() == torch.finfo(dtype).max  # saturated, not inf or NaN


def _cos_sin(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin tables [256, d] on the GPU."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(256).float(), inv)
    cos = torch.cat((angles.cos(), angles.cos()), -1).cuda()
    sin = torch.cat((angles.sin(), angles.sin()), -1).cuda()
    return cos, sin


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_rotary_kv_write_stores_the_references_fp8_bytes(dtype) -> None:
    from kvrail.kernels import rotary_kv

    g = _gen(2)
    num_tokens, d = 7, 64
    q, k, v = (
        _randn(num_tokens, 4, d, g=g),
        _randn(num_tokens, 2, d, g=g, scale=200.0),
        _randn(num_tokens, 2, d, g=g),
    )
    positions = torch.tensor([0, 5, 9, 100, 3, 2, 1], device="cuda")
    cos, sin = _cos_sin(d)
    slots = torch.tensor([0, 1, 2, -1, 30, 31, 12], dtype=torch.int64, device="cuda")
    _, k_cache, v_cache = _caches(8, 4, 2, d, dtype, g)
    ek, ev = k_cache.clone(), v_cache.clone()
    qr, kr = rotary_kv.rotary_write_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots)
    eq, ekr = reference.rotary_write_kv(positions, q, k, v, cos, sin, ek.clone(), ev.clone(), slots)
    # the rotation is bf16 arithmetic (not bit-exact across the two); what is stored must be
    # exactly the reference's rounding of the kernel's own rotated k, and of v
    torch.testing.assert_close(qr, eq, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kr, ekr, atol=2e-2 * 200, rtol=2e-2)
    reference.write_kv(kr, v, ek, ev, slots)
    assert torch.equal(_bytes(k_cache), _bytes(ek))
    assert torch.equal(_bytes(v_cache), _bytes(ev))


def test_rotary_kv_fp8_outputs_are_what_the_cache_holds() -> None:
    """The FP8-output mode (attention in FP8) stores the same cache bytes as the plain one, and
    returns q, k and v rounded exactly as the cache rounds them, with v's largest magnitude."""
    from kvrail.kernels import rotary_kv

    g = _gen(12)
    num_tokens, d = 37, 128
    q, k, v = (
        _randn(num_tokens, 8, d, g=g),
        _randn(num_tokens, 2, d, g=g, scale=200.0),  # some saturate in e4m3
        _randn(num_tokens, 2, d, g=g, scale=3.0),
    )
    positions = torch.arange(num_tokens, device="cuda")
    cos, sin = _cos_sin(d)
    slots = torch.randperm(128, generator=g)[:num_tokens].cuda()
    _, k_cache, v_cache = _caches(8, 16, 2, d, torch.float8_e4m3fn, g)
    ek, ev = k_cache.clone(), v_cache.clone()
    q8, k8, v8, v_amax = rotary_kv.rotary_write_kv_fp8(
        positions, q, k, v, cos, sin, k_cache, v_cache, slots
    )
    qr, kr = rotary_kv.rotary_write_kv(positions, q, k, v, cos, sin, ek, ev, slots)
    assert torch.equal(_bytes(k_cache), _bytes(ek)) and torch.equal(_bytes(v_cache), _bytes(ev))
    for got, want in ((q8, qr), (k8, kr), (v8, v)):
        assert got.dtype == torch.float8_e4m3fn and got.is_contiguous()
        assert torch.equal(_bytes(got), _bytes(reference.to_cache_dtype(want, got.dtype)))
    assert v_amax.item() == v8.float().abs().max().item()


@pytest.mark.parametrize("num_seqs,length", [(1, 4096), (2, 4160)])
def test_fp8_causal_attention_matches_attention_over_the_same_fp8_values(num_seqs, length):
    """cuDNN's FP8 attention (training-mode graph on Hopper) against float32 attention over the
    e4m3 q, k and v it was given: the probabilities and the output are rounded to e4m3 on the
    way, so within a few percent, and every sequence attends to itself only."""
    from kvrail.kernels import fp8_attention

    if not fp8_attention.supported(torch.device("cuda")):
        pytest.skip("cuDNN's FP8 attention needs compute capability 9.0+")
    g = _gen(13)
    hq, hkv, d = 8, 2, 128
    total = num_seqs * length
    q8, k8, v8 = (
        reference.to_cache_dtype(_randn(total, h, d, g=g, scale=2.0), torch.float8_e4m3fn)
        for h in (hq, hkv, hkv)
    )
    v_amax = v8.float().abs().amax().reshape(1)
    rows = fp8_attention.fp8_causal_attention(q8, k8, v8, v_amax, num_seqs, d**-0.5, BF16)
    assert rows.values.shape == (total, hq * d) and rows.scales.shape == (total,)
    got = reference.dequantize_rows(rows).float().view(num_seqs, length, hq, d)
    qs, ks, vs = (x.float().view(num_seqs, length, -1, d).transpose(1, 2) for x in (q8, k8, v8))
    ks, vs = (x.repeat_interleave(hq // hkv, dim=1) for x in (ks, vs))
    want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    want = want.transpose(1, 2)
    rel = (got - want).norm() / want.norm()
    assert rel < 0.05, f"relative RMS error {rel:.4f}"


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("words", [True, False])
@pytest.mark.parametrize("many", [False, True], ids=["5 seqs", "140 seqs"])
def test_decode_attention_over_an_fp8_cache_matches_the_reference(
    dtype, num_splits, words, many
) -> None:
    """Read as int32 words (the default where the layout allows) or as bytes, the same
    attention as the reference's; 140 sequences of 2 KV heads take the tiles of large batches
    (more programs than twice an H200's SMs)."""
    from kvrail.kernels import decode_attention, paged_kv

    g = _gen(3)
    seq_lens = [(i * 37) % 64 + 1 for i in range(140)] if many else [1, 17, 200, 64, 129]
    num_blocks = 1024 if many else 128
    _, k_cache, v_cache = _caches(num_blocks, 16, 2, 128, dtype, g)
    tables = _tables(seq_lens, 16, num_blocks, g)
    query = _randn(len(seq_lens), 8, 128, g=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    args = (query, k_cache, v_cache, tables, lens, 128**-0.5)
    assert paged_kv.words_fit(k_cache, v_cache, 128)
    got = decode_attention.paged_decode_attention(*args, num_splits=num_splits, fp8_words=words)
    torch.testing.assert_close(got, reference.paged_decode_attention(*args), atol=2e-2, rtol=2e-2)
    if many and num_splits is None:  # a register cap (the sweep's knob) spills, same result
        capped = decode_attention.paged_decode_attention(*args, fp8_words=words, max_registers=64)
        torch.testing.assert_close(capped, got, atol=1e-3, rtol=1e-3)
    if not words:
        return
    # the same tiles both ways (the defaults differ), so only the loads differ
    tiles = {"num_splits": num_splits, "block_n": 64, "num_warps": 4, "num_stages": 2}
    as_words = decode_attention.paged_decode_attention(*args, fp8_words=True, **tiles)
    as_bytes = decode_attention.paged_decode_attention(*args, fp8_words=False, **tiles)
    torch.testing.assert_close(as_words, as_bytes, atol=1e-3, rtol=1e-3)
    odd = k_cache[..., :96]  # rows of 96 values: not a power of two, so read as bytes
    assert not paged_kv.words_fit(odd, odd, 96)
    with pytest.raises(ValueError, match="int32 words"):
        decode_attention.paged_decode_attention(
            query[..., :96], odd, v_cache[..., :96], tables, lens, 0.1, fp8_words=True
        )


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("words", [True, False])
def test_decode_rows_sharing_fp8_blocks_attend_them_once_with_the_references_result(
    dtype, words
) -> None:
    """Eight rows sharing four blocks (a prompt's choices) and one row of its own: the shared
    blocks read once per group (`prefix_attention`), as words or as bytes, the rest split."""
    from kvrail.kernels import decode_attention
    from kvrail.kernels.shared_prefix import SharedPrefixes

    g = _gen(6)
    _, k_cache, v_cache = _caches(64, 16, 2, 128, dtype, g)
    tables = [[3, 5, 7, 9, 20 + i, 30 + i] for i in range(8)] + [[40, 41, 0, 0, 0, 0]]
    seq_lens = [64 + 1 + 3 * i for i in range(8)] + [20]
    query = _randn(9, 8, 128, g=g)
    args = (query, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device="cuda"),
            torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), 128**-0.5)  # fmt: skip
    hint = SharedPrefixes(
        *(torch.tensor(v, dtype=torch.int32, device="cuda")
          for v in ([list(range(8)), [-1] * 8], [64, 0], [64] * 8 + [0]))
    )  # fmt: skip
    for splits in (None, 3):
        got = decode_attention.paged_decode_attention(
            *args, num_splits=splits, fp8_words=words, prefix=hint
        )
        expected = reference.paged_decode_attention(*args, prefix=hint)
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_prefill_attention_over_an_fp8_cache_matches_the_reference(dtype) -> None:
    from kvrail.kernels import prefill_attention

    g = _gen(4)
    seq_lens, q_lens = [40, 100, 9], [8, 70, 9]
    _, k_cache, v_cache = _caches(64, 16, 2, 128, dtype, g)
    tables = _tables(seq_lens, 16, 64, g)
    query = _randn(sum(q_lens), 8, 128, g=g)
    starts = torch.tensor([0, 8, 78, 87], dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    args = (query, k_cache, v_cache, tables, starts, lens, 128**-0.5)
    got = prefill_attention.paged_prefill_attention(*args)
    torch.testing.assert_close(got, reference.paged_prefill_attention(*args), atol=2e-2, rtol=2e-2)


def test_block_copies_move_fp8_blocks_unchanged() -> None:
    from kvrail.kernels import block_copy

    g = _gen(5)
    region, _, _ = _caches(20, 4, 2, 64, torch.float8_e4m3fn, g)
    ids = torch.tensor([3, 7, 1], device="cuda")
    packed = block_copy.gather_blocks(region, ids)
    assert torch.equal(_bytes(packed), _bytes(region[ids]))
    other = torch.zeros_like(region)
    block_copy.scatter_blocks(packed, other, torch.tensor([0, 5, 9], device="cuda"))
    assert torch.equal(_bytes(other[5]), _bytes(region[7]))
    dst = torch.zeros_like(region)
    block_copy.copy_blocks(region, dst, ids, torch.tensor([2, 4, 6], device="cuda"))
    assert torch.equal(_bytes(dst[6]), _bytes(region[1]))


@pytest.mark.parametrize("static", [False, True])
def test_activation_quantization_matches_the_reference(static: bool) -> None:
    from kvrail.kernels import fp8_gemm

    g = _gen(6)
    x = _randn(37, 4096 + 16, g=g, scale=4.0)
    x[3] = 0.0  # an all-zero row: scale at its floor, values 0
    scale = torch.tensor(0.05, device="cuda") if static else None
    xq, scales, _ = fp8_gemm.quantize_rows(x, scale)
    xf = x.float()
    expected_scale = (
        scale.expand(37) if scale is not None else (xf.abs().amax(-1) / 448.0).clamp(min=1e-12)
    )
    torch.testing.assert_close(scales, expected_scale.float(), rtol=1e-6, atol=0)
    expected = reference.to_cache_dtype(xf / expected_scale[:, None], torch.float8_e4m3fn)
    # the kernel's float32 division may round a value across an e4m3 rounding boundary
    mismatched = (_bytes(xq) != _bytes(expected)).float().mean().item()
    assert mismatched < 1e-3
    torch.testing.assert_close(xq.float(), expected.float(), atol=0, rtol=0.07)


def _same_rows(a: reference.QuantizedRows, b: reference.QuantizedRows) -> None:
    assert torch.equal(_bytes(a.values), _bytes(b.values))
    assert torch.equal(a.scales, b.scales) and a.dtype == b.dtype


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("hidden", [4096, 1000])
def test_norms_that_quantize_write_what_quantizing_their_output_would(
    static: bool, hidden: int
) -> None:
    """The RMSNorm kernels' FP8 mode stores the bytes and scales `quantize_rows` makes of the
    plain kernels' bf16 output, and the same residual."""
    from kvrail.kernels import fp8_gemm, rms_norm

    g = _gen(hidden + static)
    x, residual = _randn(70, hidden, g=g, scale=3.0), _randn(70, hidden, g=g)
    x[5] = 0.0
    weight = (torch.rand(hidden, generator=g) + 0.5).to("cuda", BF16)
    scale = torch.tensor(0.03, device="cuda") if static else None
    expected = fp8_gemm.quantize_rows(rms_norm.rms_norm(x, weight, 1e-5), scale)
    _same_rows(rms_norm.rms_norm_fp8(x, weight, 1e-5, scale), expected)
    plain, plain_sum = rms_norm.fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    rows, summed = rms_norm.fused_add_rms_norm_fp8(x, residual.clone(), weight, 1e-5, scale)
    _same_rows(rows, fp8_gemm.quantize_rows(plain, scale))
    assert torch.equal(summed, plain_sum)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        rms_norm.rms_norm_fp8(x.half(), weight.half(), 1e-5, scale)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("inter", [14336, 1000, 28672])  # one pass, one pass, two passes
def test_silu_and_mul_that_quantizes_writes_what_quantizing_its_output_would(
    static: bool, inter: int
) -> None:
    from kvrail.kernels import fp8_gemm, silu_and_mul

    g = _gen(inter + static)
    x = _randn(33, 2 * inter, g=g, scale=2.0)
    x[7] = 0.0
    scale = torch.tensor(0.01, device="cuda") if static else None
    expected = fp8_gemm.quantize_rows(silu_and_mul.silu_and_mul(x), scale)
    _same_rows(silu_and_mul.silu_and_mul_fp8(x, scale), expected)
    assert silu_and_mul.silu_and_mul_fp8(x[:0], scale).values.shape == (0, inter)


def test_fp8_gemm_takes_rows_already_quantized() -> None:
    from kvrail.kernels import fp8_gemm

    g = _gen(11)
    x = _randn(300, 512, g=g)
    weight, scale = _fp8_weight(256, 512, g)
    rows = fp8_gemm.quantize_rows(x)
    assert torch.equal(
        fp8_gemm.fp8_linear(rows, weight, scale, None), fp8_gemm.fp8_linear(x, weight, scale, None)
    )
    with pytest.raises(ValueError, match="do not chain"):
        fp8_gemm.fp8_linear(rows, weight[:, :256], scale, None)


def _fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.randn(n, k, generator=g) * 0.02
    values, scales = reference.quantize_fp8_rows(weight)
    return values.cuda(), scales.cuda()


@pytest.mark.parametrize(("m", "n", "k"), [(64, 6144, 4096), (300, 4096, 4096), (33, 512, 1024)])
def test_fp8_gemm_matches_the_reference_that_quantizes_alike(m: int, n: int, k: int) -> None:
    from kvrail.kernels import fp8_gemm

    g = _gen(m)
    x = _randn(m, k, g=g)
    weight, scale = _fp8_weight(n, k, g)
    got = fp8_gemm.fp8_linear(x, weight, scale, None)
    expected = reference.fp8_linear(x, weight, scale, None)
    assert got.dtype == BF16 and got.shape == (m, n)
    # the GEMM accumulates in the tensor cores' FP8 precision (use_fast_accum), the reference in
    # float32: on the H200, relative L2 2.1e-3 against 1.7e-3 for bf16's own rounding
    # (bench/studies/gemm/fp8_gemm_accum.txt), and at most about 1% of the outputs' spread apart
    err = float((got.float() - expected.float()).norm() / expected.float().norm())
    assert err < 4e-3, err
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_fp8_gemm_takes_a_static_input_scale_and_refuses_other_dtypes() -> None:
    from kvrail.kernels import fp8_gemm

    g = _gen(7)
    x = _randn(48, 512, g=g)
    weight, scale = _fp8_weight(256, 512, g)
    static = torch.tensor(0.01, device="cuda")
    got = fp8_gemm.fp8_linear(x, weight, scale, None, static)
    expected = reference.fp8_linear(x, weight, scale, None, static)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-3, rtol=2e-2)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        fp8_gemm.fp8_linear(x.half(), weight, scale, None)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_gemm.fp8_linear(x[:, :500], weight[:, :500], scale, None)


def _tile_quantized_product(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int
) -> torch.Tensor:
    """What the skinny kernel's e4m3 mode computes, in float32: x quantized to e4m3 per row and
    K tile of `block_k` columns (a scale per row and tile), each tile's product scaled."""
    out = torch.zeros(x.shape[0], weight.shape[0], device=x.device)
    for k0 in range(0, x.shape[1], block_k):
        xt = x[:, k0 : k0 + block_k].float()
        xs = (xt.abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
        xq = reference.to_cache_dtype(xt / xs, torch.float8_e4m3fn).float()
        out += (xq @ weight[:, k0 : k0 + block_k].float().T) * xs
    return out * scale


@pytest.mark.parametrize("fp8_dot", ["e4m3", "float16", "x"])
@pytest.mark.parametrize("m", [1, 7, 32])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (200, 336)])
def test_skinny_fp8_weights_match_the_product_they_stand_for(
    m: int, n: int, k: int, fp8_dot: str
) -> None:
    """e4m3: against the same tile-wise quantization of x in float32; float16 and x's dtype:
    against x times the dequantized weight."""
    import dataclasses

    from kvrail.kernels import skinny_gemm

    g = _gen(m + n)
    x = _randn(m, k, g=g)
    weight, scale = _fp8_weight(n, k, g)
    config = dataclasses.replace(skinny_gemm.pick_config(m, n, k, 1), fp8_dot=fp8_dot)
    got = skinny_gemm.linear(x, weight, None, config, scale).float()
    if fp8_dot == "e4m3":
        expected = _tile_quantized_product(x, weight, scale, config.block_k)
    else:
        expected = x.float() @ (weight.float() * scale[:, None]).T
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=2e-2)
    exact = x.float() @ (weight.float() * scale[:, None]).T
    assert float((got - exact).norm() / exact.norm()) < (0.05 if fp8_dot == "e4m3" else 0.01)


@pytest.mark.parametrize("m", [1, 32])
def test_skinny_fp8_gated_equals_the_projection_then_silu_and_mul(m: int) -> None:
    from kvrail.kernels import silu_and_mul, skinny_gemm

    g = _gen(8)
    x = _randn(m, 4096, g=g)
    weight, scale = _fp8_weight(2 * 1024, 4096, g)
    fused = skinny_gemm.gated_linear(x, weight, weight_scale=scale)
    unfused = silu_and_mul.silu_and_mul(skinny_gemm.linear(x, weight, weight_scale=scale))
    assert torch.equal(fused, unfused)
    with pytest.raises(ValueError, match="weight_scale"):
        skinny_gemm.linear(x, weight)
    bad = skinny_gemm.SkinnyConfig(64, 256, 1, 4, 3, fp8_dot="int8")
    with pytest.raises(ValueError, match="fp8_dot"):
        skinny_gemm.linear(x, weight, None, bad, scale)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m", [1, 7, 32])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (200, 336)])
def test_skinny_fp8_over_quantized_rows_matches_the_reference(
    m: int, n: int, k: int, static: bool
) -> None:
    """x quantized per token (or with a static scale), as the RMSNorms before QKV and gate/up
    write it: the kernel multiplies those e4m3 rows as they are, and its product is the
    reference FP8 GEMM's over the same rows, gated or not."""
    from kvrail.kernels import silu_and_mul, skinny_gemm

    g = _gen(3 * m + n)
    x = _randn(m, k, g=g)
    weight, scale = _fp8_weight(n, k, g)
    static_scale = torch.tensor([0.01], device="cuda") if static else None
    rows = reference.quantize_rows(x, static_scale)
    got = skinny_gemm.linear(rows, weight, None, None, scale)
    assert got.dtype == BF16
    expected = reference.fp8_linear(rows, weight, scale, None)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=2e-2)
    if n % 2 == 0:
        gated = skinny_gemm.gated_linear(rows, weight, None, None, scale)
        unfused = silu_and_mul.silu_and_mul(skinny_gemm.linear(rows, weight, None, None, scale))
        assert torch.equal(gated, unfused)
    with pytest.raises(ValueError, match="quantized rows"):
        skinny_gemm.linear(rows, weight.to(BF16))


def test_decode_rows_come_quantized_from_the_norms_but_not_from_a_skinny_gate_up() -> None:
    """At decode sizes the RMSNorm before an FP8 projection writes e4m3 rows (the skinny kernel
    multiplies them as they are); the gate/up projection keeps its bfloat16 output there (its
    epilogue has no whole row to scale) and quantizes it only for prefill-sized batches."""
    g = _gen(11)
    weight, _ = _fp8_weight(256, 512, g)
    for m, gated_quantizes in ((8, False), (200, True)):
        x = _randn(m, 512, g=g)
        assert dispatch.takes_quantized_rows(x, weight)
        assert dispatch.quantize_gated_output(x, weight) is gated_quantizes
    assert not dispatch.takes_quantized_rows(x, weight.to(BF16))


def test_dispatch_sends_decode_rows_to_the_skinny_kernel_and_prefill_rows_to_the_fp8_gemm() -> None:
    from kvrail.kernels import fp8_gemm, skinny_gemm

    g = _gen(9)
    weight, scale = _fp8_weight(1024, 2048, g)
    for m, expected in (
        (8, lambda x: skinny_gemm.linear(x, weight, weight_scale=scale)),
        (200, lambda x: fp8_gemm.fp8_linear(x, weight, scale, None)),
    ):
        x = _randn(m, 2048, g=g)
        assert torch.equal(dispatch.linear(x, weight, None, scale), expected(x))


def test_an_fp8_engine_replays_its_cuda_graphs_like_its_eager_steps() -> None:
    from transformers import AutoModelForCausalLM

    from kvrail.sampling import SamplingParams
    from kvrail.worker.engine.engine import LLMEngine, make_fingerprint
    from kvrail.worker.models.llama import LlamaForCausalLM
    from kvrail.worker.testing import assert_engine_empty, make_engine_config, tiny_llama_config

    hf = tiny_llama_config(hidden_size=64, intermediate_size=128, vocab_size=128)
    torch.manual_seed(5)
    state = AutoModelForCausalLM.from_config(hf).state_dict()

    def run(graphs: bool) -> list[list[int]]:
        model = LlamaForCausalLM.build(hf, state, dtype=BF16, device="cuda", quantization="fp8")
        # decode graphs only: a mixed graph reads a fresh chunk's own K and V back from the FP8
        # cache, where an eager step attends over them unrounded (docs/worker.md), so their
        # tokens may part at a near tie
        config = make_engine_config(
            enable_cuda_graphs=graphs, max_num_seqs=20, kv_dtype="float8_e4m3fn",
            max_model_len=256, max_mixed_graph_tokens=0,
        )  # fmt: skip
        engine = LLMEngine(model, config, make_fingerprint(model, config, "w", "t"))
        prompts = [list(range(5, 5 + n)) for n in (3, 40, 9, 30, 1)]
        out = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        assert_engine_empty(engine)
        assert engine.fingerprint.quantization == "fp8"
        return out

    assert run(graphs=True) == run(graphs=False)
