"""Dispatch without a GPU: CPU tensors take the torch references and never touch Triton; and the
engine gives the same tokens when its attention runs through the (interpreted) Triton kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvrail.kernels import dispatch, reference
from kvrail.kernels.testing import load_kernels


def test_cpu_tensors_use_the_reference_and_never_import_triton(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_triton(name: str) -> None:
        raise AssertionError(f"CPU dispatch reached Triton module {name}")

    monkeypatch.setattr(dispatch, "_triton", no_triton)
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 6, 4, 2, 16, generator=g).unbind(0)
    query = torch.randn(2, 4, 16, generator=g)
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    lens = torch.tensor([7, 3], dtype=torch.int32)
    out = dispatch.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.25)
    assert torch.equal(
        out, reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.25)
    )
    dispatch.write_kv(query[:, :2], query[:, 2:], k_cache, v_cache, torch.tensor([0, 5]))
    assert torch.equal(k_cache[0, 0], query[0, :2]) and torch.equal(v_cache[1, 1], query[1, 2:])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter path")
def test_engine_tokens_are_identical_with_interpreted_triton_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvrail.sampling import SamplingParams
    from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

    def run() -> list[list[int]]:
        engine = make_engine(tiny_llama_config(), seed=3, max_num_batched_tokens=16)
        prompts = [list(range(5, 30)), [7, 8, 9], list(range(40, 51))]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        assert_engine_empty(engine)
        return outputs

    expected = run()
    k = load_kernels()
    triton_ops = SimpleNamespace(
        write_kv=k["kv_write"].write_kv,
        paged_decode_attention=k["decode_attention"].paged_decode_attention,
        paged_prefill_attention=k["prefill_attention"].paged_prefill_attention,
        rms_norm=k["rms_norm"].rms_norm,
        fused_add_rms_norm=k["rms_norm"].fused_add_rms_norm,
        silu_and_mul=k["silu_and_mul"].silu_and_mul,
        rotary_write_kv=k["rotary_kv"].rotary_write_kv,
        argmax=k["argmax"].argmax,
    )
    monkeypatch.setattr(dispatch, "reference", triton_ops)
    assert run() == expected


def _same_rows(a: reference.QuantizedRows, b: reference.QuantizedRows) -> bool:
    return (
        torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8))
        and torch.equal(a.scales, b.scales)
        and a.dtype == b.dtype
    )


@pytest.mark.parametrize("static", [False, True])
def test_producers_quantize_for_fp8_projections_as_the_projection_would(static: bool) -> None:
    """On a CPU every FP8 projection multiplies rows quantized per token, so the norms and the
    gated projection before one write quantized rows, and the product is the same as over the
    unquantized activations; a bf16 weight never takes quantized rows."""
    g = torch.Generator().manual_seed(3)
    x, residual = torch.randn(5, 64, generator=g) * 3, torch.randn(5, 64, generator=g)
    norm_w = torch.rand(64, generator=g) + 0.5
    up_values, up_scale = reference.quantize_fp8_rows(torch.randn(96, 64, generator=g) * 0.1)
    down_values, down_scale = reference.quantize_fp8_rows(torch.randn(64, 48, generator=g) * 0.1)
    static_scale = torch.tensor(0.02) if static else None
    assert dispatch.takes_quantized_rows(x, up_values)
    assert not dispatch.takes_quantized_rows(x, torch.randn(96, 64))

    rows, summed = dispatch.rms_norm_fp8(x, residual.clone(), norm_w, 1e-6, static_scale)
    normed, expected_sum = reference.fused_add_rms_norm(x, residual.clone(), norm_w, 1e-6)
    assert summed is not None and torch.equal(summed, expected_sum)
    assert _same_rows(rows, reference.quantize_rows(normed, static_scale))
    alone, no_sum = dispatch.rms_norm_fp8(x, None, norm_w, 1e-6, static_scale)
    expected = reference.quantize_rows(reference.rms_norm(x, norm_w, 1e-6), static_scale)
    assert no_sum is None and _same_rows(alone, expected)

    act = dispatch.gated_linear_fp8(rows, up_values, None, up_scale, static_scale, static_scale)
    unfused = dispatch.gated_linear(normed, up_values, None, up_scale, static_scale)
    assert _same_rows(act, reference.quantize_rows(unfused, static_scale))
    assert torch.equal(
        dispatch.linear(act, down_values, None, down_scale),
        dispatch.linear(unfused, down_values, None, down_scale, static_scale),
    )
    with pytest.raises(ValueError, match="quantized rows are for FP8 weights"):
        dispatch.linear(act, torch.randn(64, 48), None)


def test_the_fp8_rotary_pass_returns_what_an_fp8_cache_holds_and_rows_dequantize() -> None:
    """On a CPU: the same cache bytes as the plain rotary pass, q, k and v rounded as the cache
    rounds them (a k beyond e4m3's range saturates at 448), and v's largest magnitude; e4m3
    rows come back as their values times their scales."""
    g = torch.Generator().manual_seed(4)
    fp8 = torch.float8_e4m3fn
    q, k = torch.randn(6, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g) * 300
    v = torch.randn(6, 2, 16, generator=g)
    positions = torch.tensor([0, 1, 2, 7, 8, 9])
    angles = torch.outer(torch.arange(16).float(), 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16))
    cos, sin = (torch.cat((f(angles), f(angles)), -1) for f in (torch.cos, torch.sin))
    caches = [torch.zeros(4, 4, 2, 16, dtype=fp8) for _ in range(4)]
    slots = torch.tensor([3, 4, 5, 9, 10, -1])
    q8, k8, v8, v_amax = dispatch.rotary_write_kv_fp8(
        positions, q, k, v, cos, sin, caches[0], caches[1], slots
    )
    q_rot, k_rot = dispatch.rotary_write_kv(
        positions, q, k, v, cos, sin, caches[2], caches[3], slots
    )
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in ((caches[0], caches[2]), (caches[1], caches[3])))  # fmt: skip
    for got, want in ((q8, q_rot), (k8, k_rot), (v8, v)):
        assert got.dtype == fp8
        assert torch.equal(got.float(), want.clamp(-448, 448).to(fp8).float())
    assert k8.float().abs().max() == 448
    assert v_amax.shape == (1,) and v_amax.item() == v8.float().abs().max().item()
    rows = reference.QuantizedRows(q8.view(6, -1), torch.full((6,), 0.5), torch.float32)
    back = reference.dequantize_rows(rows)
    assert back.dtype == torch.float32 and torch.equal(back, q8.view(6, -1).float() * 0.5)
