from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvrail.fingerprint import ModelFingerprint


def make(**overrides: Any) -> ModelFingerprint:
    base: dict[str, Any] = dict(
        weights_id="gguf-sha256:abc", tokenizer_id="tok:abc", dtype="bfloat16",
        kv_dtype="bfloat16", block_size=16, num_layers=32, num_kv_heads=8, head_dim=128,
    )  # fmt: skip
    base.update(overrides)
    return ModelFingerprint(**base)


@pytest.mark.parametrize(
    "field,value",
    [
        ("weights_id", "gguf-sha256:other"),
        ("tokenizer_id", "tok:other"),
        ("dtype", "float16"),
        ("kv_dtype", "float8_e4m3fn"),
        ("block_size", 32),
        ("num_kv_heads", 4),
        ("kv_layout", "HND"),
        ("rope_theta", 500000.0),
        ("rope_scaling", (("rope_type", "llama3"), ("factor", "8.0"))),
        ("tensor_parallel_size", 2),
        ("quantization", "fp8"),
    ],
)
def test_every_field_changes_the_digest(field: str, value: object) -> None:
    base = make()
    changed = dataclasses.replace(base, **{field: value})
    assert changed.digest != base.digest
    assert not base.is_compatible(changed)


def test_digest_is_stable_and_short_is_its_prefix() -> None:
    assert make().digest == make().digest
    assert make().digest.startswith(make().short) and len(make().short) == 12


def test_kv_bytes_per_block_matches_the_llama3_8b_shape() -> None:
    # 2 (K,V) x 32 layers x 8 heads x 128 dim x 2 bytes = 128 KiB per token
    assert make().kv_bytes_per_block(itemsize=2) == 128 * 1024 * 16
    assert make(tensor_parallel_size=2).kv_bytes_per_block(itemsize=2) == 64 * 1024 * 16


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"dtype": "float64"}, "dtype"),
        ({"kv_dtype": "int4"}, "kv_dtype"),
        ({"kv_layout": "XYZ"}, "kv_layout"),
        ({"block_size": 0}, "block_size"),
        ({"weights_id": ""}, "weights_id"),
        ({"num_kv_heads": 8, "tensor_parallel_size": 3}, "divisible"),
        ({"quantization": "int4"}, "quantization"),
    ],
)
def test_invalid_fingerprints_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**overrides)


def test_kv_heads_fewer_than_ranks_are_replicated_one_per_rank() -> None:
    replicated = make(num_kv_heads=2, tensor_parallel_size=8)
    assert replicated.kv_bytes_per_block(itemsize=2) == 2 * 32 * 1 * 128 * 16 * 2


@pytest.mark.parametrize("tp_a,tp_b", [(1, 2), (2, 4), (1, 8)])
def test_workers_of_different_tensor_parallel_layouts_never_pair(tp_a: int, tp_b: int) -> None:
    """The rule: pairing needs equal digests, and T is in the digest; no re-sharding."""
    a, b = make(tensor_parallel_size=tp_a), make(tensor_parallel_size=tp_b)
    assert not a.is_compatible(b) and not b.is_compatible(a)
    assert a.is_compatible(make(tensor_parallel_size=tp_a))
