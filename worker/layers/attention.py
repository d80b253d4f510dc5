"""Paged attention for one layer over a mixed batch: decode tokens first, then prefill tokens.

Every token's K and V are written into its slot first; then the decode queries attend over their
paged context with the decode kernel and the prefill queries (chunks, possibly after a cached
prefix) with the prefill kernel. Kernels come from `kvrail.kernels.dispatch` (Triton on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrail.kernels import dispatch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step inputs shared by all layers. Tokens are packed: `num_decode_tokens` decode tokens
    (one per decode sequence), then the prefill chunks in `prefill_query_start_loc` order."""

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_max_query_len: int

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_seq_lens.shape[0])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; writes k/v into the caches."""
    dispatch.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
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
            )
        )
    if metadata.num_prefills:
        parts.append(
            dispatch.paged_prefill_attention(
                q[num_decode:],
                k_cache,
                v_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start_loc,
                metadata.prefill_seq_lens,
                scale,
                metadata.prefill_max_query_len,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)
