"""The attention layer's prefill split: chunks without a prefix take causal SDPA (batched over
runs of equal length), chunks after a paged prefix take the paged kernel, and the mixed batch
equals the references, on CPU and (marker `gpu`) on CUDA in bf16 through flash attention."""

from __future__ import annotations

import pytest
import torch

from kvrail.kernels import reference
from kvrail.worker.layers.attention import AttentionMetadata, fresh_runs, paged_attention


def test_fresh_runs_group_consecutive_equal_length_chunks_without_prefix() -> None:
    q_lens = [7, 7, 5, 4, 4, 4, 3, 0]
    computed = [0, 0, 15, 0, 0, 0, 9, 0]
    assert fresh_runs(q_lens, computed) == ((0, 7, 2), (19, 4, 3))
    assert fresh_runs([8, 8], [0, 3]) == ((0, 8, 1),)
    assert fresh_runs([], []) == ()


def _check_mixed_batch(device: str, dtype: torch.dtype, tol: float, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(hkv * d)
    bs, hq = 4, 3 * hkv
    decode_lens = [9, 1]
    chunks = [(7, 7), (7, 7), (5, 20), (4, 4), (30, 30)]  # (query length, context length)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, bs, hkv, d, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    contexts = decode_lens + [c for _, c in chunks]
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in contexts]
    for table, ctx in zip(tables, contexts, strict=True):  # the full context's KV, as written
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)], device=device)
        kv = torch.randn(2, ctx, hkv, d, generator=g).to(device, dtype)
        reference.write_kv(kv[0], kv[1], k_cache, v_cache, slots)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    padded = padded.to(device)
    # each token's own k/v, read back from the cache (what the fused rotary kernel returns)
    rows_k, rows_v = [], []
    for i, (q_len, ctx) in enumerate(zip([1, 1] + [q for q, _ in chunks], contexts, strict=True)):
        table = tables[i]
        for p in range(ctx - q_len, ctx):
            rows_k.append(k_cache[table[p // bs], p % bs])
            rows_v.append(v_cache[table[p // bs], p % bs])
    k, v = torch.stack(rows_k), torch.stack(rows_v)
    q = torch.randn(k.shape[0], hq, d, generator=g).to(device, dtype)
    starts = [0] + torch.tensor([q for q, _ in chunks]).cumsum(0).tolist()
    i32 = {"dtype": torch.int32, "device": device}
    metadata = AttentionMetadata(
        slot_mapping=torch.full((k.shape[0],), -1, device=device),
        num_decode_tokens=2,
        decode_block_tables=padded[:2],
        decode_seq_lens=torch.tensor(decode_lens, **i32),
        prefill_block_tables=padded[2:],
        prefill_query_start_loc=torch.tensor(starts, **i32),
        prefill_seq_lens=torch.tensor([c for _, c in chunks], **i32),
        prefill_max_query_len=30,
        prefill_fresh_runs=fresh_runs([q for q, _ in chunks], [c - q for q, c in chunks]),
        prefill_has_prefix=True,
    )
    assert metadata.prefill_fresh_runs == ((0, 7, 2), (19, 4, 1), (23, 30, 1))
    scale = d**-0.5
    out = paged_attention(q, k, v, k_cache, v_cache, metadata, scale)
    expected_decode = reference.paged_decode_attention(
        q[:2], k_cache, v_cache, padded[:2], metadata.decode_seq_lens, scale
    )
    expected_prefill = reference.paged_prefill_attention(
        q[2:],
        k_cache,
        v_cache,
        padded[2:],
        metadata.prefill_query_start_loc,
        metadata.prefill_seq_lens,
        scale,
    )
    expected = torch.cat([expected_decode, expected_prefill])
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_mixed_batch_with_sdpa_and_paged_prefill_equals_the_references_on_cpu() -> None:
    _check_mixed_batch("cpu", torch.float32, 2e-5, hkv=2, d=16)
    _check_mixed_batch("cpu", torch.float32, 2e-5, hkv=1, d=24)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_mixed_batch_with_sdpa_and_paged_prefill_equals_the_references_on_gpu(dtype, tol) -> None:
    _check_mixed_batch("cuda", dtype, tol, hkv=8, d=128)


def _fresh_step(device: str, lengths: list[int], num_decode: int = 0) -> AttentionMetadata:
    i32 = {"dtype": torch.int32, "device": device}
    empty = torch.zeros(0, 1, **i32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(num_decode + sum(lengths), dtype=torch.int64, device=device),
        num_decode_tokens=num_decode,
        decode_block_tables=empty,
        decode_seq_lens=torch.zeros(0, **i32),
        prefill_block_tables=empty,
        prefill_query_start_loc=torch.tensor([0, *lengths], **i32).cumsum(0),
        prefill_seq_lens=torch.tensor(lengths, **i32),
        prefill_max_query_len=max(lengths),
        prefill_fresh_runs=fresh_runs(lengths, [0] * len(lengths)),
        prefill_has_prefix=False,
    )


def _fp8_cases() -> list[tuple[list[int], int, torch.dtype, int]]:
    """(prompt lengths, decode tokens, cache dtype, sequences attending in FP8)."""
    fp8 = torch.float8_e4m3fn
    return [
        ([8192], 0, fp8, 1),
        ([4096, 4096], 0, fp8, 2),
        ([4095], 0, fp8, 0),  # short: flash attention, no plan per length
        ([4096, 5000], 0, fp8, 0),  # two lengths: not one run
        ([4096], 3, fp8, 0),  # decode tokens in the step
        ([8192], 0, torch.float8_e5m2, 0),  # e5m2 cache: the bfloat16 path
        ([8192], 0, torch.bfloat16, 0),
    ]


@pytest.mark.parametrize("case", range(7))
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_only_steps_of_fresh_long_prompts_over_an_e4m3_cache_attend_in_fp8(case, device) -> None:
    """On the CPU exactly the steps named; on CUDA those named on Hopper (none before it, or
    with `_FP8_ON_CUDA` off)."""
    from kvrail.kernels import fp8_attention
    from kvrail.worker.layers import attention

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lengths, num_decode, dtype, expected = _fp8_cases()[case]
    metadata = _fresh_step(device, lengths, num_decode)
    cache = torch.zeros(2, 16, 1, 16, dtype=dtype, device=device)
    if device == "cuda" and not (
        attention._FP8_ON_CUDA and fp8_attention.supported(torch.device(device))
    ):
        expected = 0
    assert attention.fp8_prefill_sequences(metadata, num_decode + sum(lengths), cache) == expected
