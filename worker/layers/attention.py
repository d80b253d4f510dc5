"""Paged attention for one layer over a mixed batch: decode tokens first, then prefill tokens.

The caller has already written every token's K and V into its slot (fused with rotary, see
`kvrail.kernels.dispatch.rotary_write_kv`). Decode queries attend over their paged context with
the split-K decode kernel. Prefill chunks that start at position 0 (no cached prefix, no earlier
chunk: the common long-prompt case) run causal `scaled_dot_product_attention` on their own
q/k/v, batched over runs of equal-length chunks (on CUDA flash attention below 4,096 tokens and
cuDNN's from there: see `_CUDNN_MIN_LEN`); chunks after a paged prefix run the paged prefill
kernel, which skips the others. A captured mixed step (`prefill_tiles` set: see
`kvrail.worker.engine.cuda_graph`) has no decode part: its decode tokens are one-token chunks, and
one tiled launch of the paged kernel computes every chunk. Kernels come from
`kvrail.kernels.dispatch` (Triton on CUDA, torch references on CPU).

Over an e4m3 KV cache, a step that is nothing but fresh prompts of one length from
`_CUDNN_MIN_LEN` tokens on (`fp8_prefill_sequences`) attends in FP8 instead: the model's layer
takes q, k and v from the rotary pass in e4m3 as the cache rounds them, and the output goes to
the output projection still quantized (e4m3 rows over 256 / the largest |v|). On the CPU the
reference computes it in float32 over those values. On CUDA it is cuDNN's FP8 flash attention
(`kvrail.kernels.fp8_attention`), as vLLM's FlashAttention-3 path attends in FP8 over an FP8
cache; `bench/engine/README.md` has its speed and its error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvrail.kernels import dispatch
from kvrail.kernels.shared_prefix import SharedPrefixes


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step inputs shared by all layers. Tokens are packed: `num_decode_tokens` decode tokens
    (one per decode sequence), then the prefill chunks in `prefill_query_start_loc` order.

    `prefill_fresh_runs` lists consecutive prefill chunks without a prefix and of equal length as
    (first token offset among the prefill tokens, chunk length, number of chunks); those chunks
    take the SDPA path. `prefill_has_prefix` says whether any chunk needs the paged kernel.
    `prefill_tiles` (short and long tile maps, `kvrail.kernels.tile_map`): every chunk runs the
    tiled paged kernel, and the fresh runs are not used. `decode_prefix`: decode rows that share
    their first blocks (`kvrail.worker.engine.shared_prefix`), which the decode kernel then reads
    once per group."""

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_max_query_len: int
    prefill_fresh_runs: tuple[tuple[int, int, int], ...] = ()
    prefill_has_prefix: bool = True
    prefill_tiles: tuple[torch.Tensor, torch.Tensor] | None = None
    decode_prefix: SharedPrefixes | None = None

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_seq_lens.shape[0])


def fresh_runs(query_lens: list[int], num_computed: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Group prefill chunks with no computed prefix into runs of consecutive equal lengths."""
    runs: list[tuple[int, int, int]] = []
    offset = 0
    previous_fresh = False
    for q_len, computed in zip(query_lens, num_computed, strict=True):
        fresh = computed == 0 and q_len > 0
        if fresh and previous_fresh and runs[-1][1] == q_len:
            start, length, count = runs[-1]
            runs[-1] = (start, length, count + 1)
        elif fresh:
            runs.append((offset, q_len, 1))
        previous_fresh = fresh
        offset += q_len
    return tuple(runs)


# Torch's first choice on Hopper, cuDNN's fused attention, builds a plan for every new shape: 62-82
# ms on the H200 for each prompt length it has not seen, a stall of the whole step (every running
# decode waits), where flash attention has no setup (0.4-0.5 ms a call). Serving sees a new length
# with nearly every prompt, so shorter sequences never take cuDNN. From 4,096 tokens on, cuDNN is
# faster (8,192: 0.95 against 1.76 ms a layer) and its setup a fraction of the prefill's own time.
# bench/studies/attention/sdpa_shapes.txt has the figures.
_CUDNN_MIN_LEN = 4096
_NO_CUDNN = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


# Whether CUDA steps attend in FP8 (on Hopper): on since cuDNN's training-mode FP8 graph passed
# its GPU tests on an H100 (within 5% RMS of float32 attention over the same e4m3 inputs) and took
# the FP8 engine's 8k prefill from 0.141 to 0.128 s (bench/engine/README.md). Off only for
# bench/studies/attention/fp8_attention_logits.py's comparison, in its own process.
_FP8_ON_CUDA = True


def fp8_prefill_sequences(metadata: AttentionMetadata, num_tokens: int, cache: torch.Tensor) -> int:
    """How many sequences this step's attention computes in FP8: all of them when the step is
    one run of fresh prefill chunks of `_CUDNN_MIN_LEN` tokens or more (nothing cached before
    them, no decode tokens) over an e4m3 KV cache (`cache`: the whole region or a layer's), on
    the CPU or (with `_FP8_ON_CUDA`) on a GPU that has the kernel; else 0. One decision a step:
    every layer's cache has the same dtype and device."""
    runs = metadata.prefill_fresh_runs
    if (
        cache.dtype != torch.float8_e4m3fn
        or metadata.num_decode_tokens
        or metadata.prefill_tiles is not None
        or len(runs) != 1
    ):
        return 0
    _, length, count = runs[0]
    if length * count != num_tokens or length < _CUDNN_MIN_LEN:
        return 0
    if cache.device.type == "cpu":
        return count
    from kvrail.kernels import fp8_attention  # its cuDNN import waits for the first call

    return count if _FP8_ON_CUDA and fp8_attention.supported(cache.device) else 0


def causal_self_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, scale: float
) -> torch.Tensor:
    """`num_seqs` equal-length sequences packed in q [n*L, Hq, D], k/v [n*L, Hkv, D], each
    attending causally to itself only -> [n*L, Hq, D]."""
    total, num_heads, head_dim = q.shape
    length = total // num_seqs
    qs = q.view(num_seqs, length, num_heads, head_dim).transpose(1, 2)
    ks = k.reshape(num_seqs, length, k.shape[1], head_dim).transpose(1, 2)
    vs = v.reshape(num_seqs, length, v.shape[1], head_dim).transpose(1, 2)
    short = q.device.type == "cuda" and length < _CUDNN_MIN_LEN
    with sdpa_kernel(list(_NO_CUDNN)) if short else contextlib.nullcontext():
        out = functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=ks.shape[1] != num_heads
        )
    return out.transpose(1, 2).reshape(total, num_heads, head_dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (already in the caches) -> [T, Hq, D]."""
    num_decode = metadata.num_decode_tokens
    parts = []
    if num_decode:
        parts.append(
            dispatch.paged_decode_attention(
                q[:num_decode],
                k_cache,
                v_cache,
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
                scale,
                prefix=metadata.decode_prefix,
            )
        )
    if metadata.prefill_tiles is not None:
        parts.append(
            dispatch.tiled_prefill_attention(
                q[num_decode:],
                k_cache,
                v_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start_loc,
                metadata.prefill_seq_lens,
                scale,
                *metadata.prefill_tiles,
            )
        )
    elif metadata.num_prefills:
        pq, pk, pv = q[num_decode:], k[num_decode:], v[num_decode:]
        runs = metadata.prefill_fresh_runs
        if len(runs) == 1 and runs[0][1] * runs[0][2] == pq.shape[0]:
            # one run of fresh chunks is every prefill token: its result is the output as it
            # is (copied into a buffer, a 16k-token prefill spent 2 ms a step on the copies)
            out = causal_self_attention(pq, pk, pv, runs[0][2], scale)
        else:
            if metadata.prefill_has_prefix:
                out = dispatch.paged_prefill_attention(
                    pq,
                    k_cache,
                    v_cache,
                    metadata.prefill_block_tables,
                    metadata.prefill_query_start_loc,
                    metadata.prefill_seq_lens,
                    scale,
                    metadata.prefill_max_query_len,
                    skip_fresh=bool(runs),
                )
            else:
                out = torch.empty_like(pq)
            for start, length, count in runs:
                end = start + length * count
                out[start:end] = causal_self_attention(
                    pq[start:end], pk[start:end], pv[start:end], count, scale
                )
        parts.append(out)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
