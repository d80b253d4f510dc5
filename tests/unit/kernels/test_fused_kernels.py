"""The fused elementwise kernels (residual add + RMSNorm, SiLU * mul, rotary + KV write) against
their torch references: interpreted on CPU with small irregular shapes, and under the `gpu` marker
on CUDA with Llama-3-8B shapes in every dtype. Inputs are seeded; tolerances by dtype."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvrail.kernels import reference
from kvrail.kernels.testing import load_kernels

HAS_CUDA = torch.cuda.is_available()
_MODULES = load_kernels()
NORM, SILU, ROTARY = (_MODULES[n] for n in ("rms_norm", "silu_and_mul", "rotary_kv"))
DEVICE = "cuda" if HAS_CUDA else "cpu"
TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32] if not HAS_CUDA else [torch.float32, torch.float16, torch.bfloat16]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _randn(*shape: int, g: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _check_rms_norm(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(hidden)
    x, residual = _randn(tokens, hidden, g=g, dtype=dtype), _randn(tokens, hidden, g=g, dtype=dtype)
    weight = (1 + 0.1 * _randn(hidden, g=g)).to(dtype)
    _close(NORM.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    out, new_residual = NORM.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert new_residual is residual  # updated in place
    _close(out, expected_out)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)  # one rounding


def _check_silu_and_mul(tokens: int, inter: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(inter)
    x = _randn(tokens, 2 * inter, g=g, dtype=dtype) * 3
    _close(SILU.silu_and_mul(x), reference.silu_and_mul(x))


def _check_rotary(tokens: int, bs: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(hq * d + bs)
    qkv = _randn(tokens, (hq + 2 * hkv) * d, g=g, dtype=dtype)  # packed, so q/k/v are strided
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    from kvrail.worker.layers.rotary import RotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    scaling |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rotary = RotaryEmbedding(d, 4096, 500000.0, scaling).to(DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    num_blocks = -(-tokens // bs) + 3
    region = _randn(num_blocks, 2, 2, bs, hkv, d, g=g, dtype=dtype)
    expected_region = region.clone()
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens].to(DEVICE)
    slots[tokens // 2] = -1  # skipped
    args = (positions, q, k, v, rotary.cos, rotary.sin)
    q_rot, k_rot = ROTARY.rotary_write_kv(*args, region[:, 1, 0], region[:, 1, 1], slots)
    ref = reference.rotary_write_kv(
        *args, expected_region[:, 1, 0], expected_region[:, 1, 1], slots
    )
    _close(q_rot, ref[0])
    _close(k_rot, ref[1])
    _close(region, expected_region)
    assert torch.equal(region[:, 0], expected_region[:, 0])  # the other layer is untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(7, 40), (1, 16), (3, 100)])
def test_rms_norm_and_fused_residual_add_match_reference(tokens, hidden, dtype) -> None:
    _check_rms_norm(tokens, hidden, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(5, 37), (2, 1500)])  # one and two column tiles
def test_silu_and_mul_matches_reference(tokens: int, inter: int, dtype) -> None:
    _check_silu_and_mul(tokens, inter, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "bs", "hq", "hkv", "d"),
    [(9, 16, 4, 1, 16), (6, 5, 6, 2, 24), (4, 1, 3, 3, 16)],
    ids=["bs16-gqa4-d16", "bs5-gqa3-d24", "bs1-mha-d16"],
)
def test_rotary_with_kv_write_matches_reference(tokens, bs, hq, hkv, d, dtype) -> None:
    _check_rotary(tokens, bs, hq, hkv, d, dtype)


BAD_CALLS: list[tuple[str, Callable[[], object]]] = [
    (
        "rms norm weight of the wrong size",
        lambda: NORM.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-5),
    ),
    (
        "fused add with a residual of another shape",
        lambda: NORM.fused_add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5),
    ),
    ("silu and mul of an odd width", lambda: SILU.silu_and_mul(torch.zeros(2, 7))),
    (
        "rotary with a cos table of another head dim",
        lambda: ROTARY.rotary_write_kv(
            torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, 4, 16),
            torch.zeros(2, 2, 16),
            torch.zeros(2, 2, 16),
            torch.zeros(8, 8),
            torch.zeros(8, 8),
            torch.zeros(4, 2, 2, 16),
            torch.zeros(4, 2, 2, 16),
            torch.zeros(2, dtype=torch.int64),
        ),
    ),
]


@pytest.mark.parametrize(("case", "call"), BAD_CALLS, ids=[c for c, _ in BAD_CALLS])
def test_fused_launchers_reject_bad_shapes(case: str, call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the messages differ per check
        call()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_kernels_match_reference_on_llama3_8b_shapes(dtype: torch.dtype) -> None:
    _check_rms_norm(300, 4096, dtype)
    _check_silu_and_mul(300, 14336, dtype)
    _check_rotary(300, 16, 32, 8, 128, dtype)
