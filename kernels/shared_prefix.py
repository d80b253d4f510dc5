"""Decode rows that share their first KV blocks: the launch hint `SharedPrefixes` and its check.

Torch only (no Triton), for the references, the dispatcher and the engine that builds the hint
(`kvrail.worker.engine.shared_prefix`); the kernel that uses it is
`kvrail.kernels.prefix_attention`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SharedPrefixes(NamedTuple):
    """Decode rows whose block tables begin with the same blocks (a prompt's `n` choices, a system
    prompt in the prefix cache), for `paged_decode_attention` to read those blocks once per group:
    `rows` [G, M] int32, each group's rows (-1: none; the first is always a row), `tokens` [G]
    int32, how many tokens its rows share (0: an unused group, as a captured graph pads them), and
    `starts` [S] int32, each row's shared tokens (its group's; 0 outside any group). A row shares
    whole blocks and fewer tokens than its context. The result is the one without it."""

    rows: torch.Tensor
    tokens: torch.Tensor
    starts: torch.Tensor


def check_shared_prefixes(
    prefix: SharedPrefixes, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> None:
    """Raises ValueError unless `prefix` holds what its docstring says of these tables (host
    copies: the reference's check, never a kernel's)."""
    tables, lens = block_tables.cpu(), seq_lens.cpu()
    starts = torch.zeros_like(lens)
    for rows, tokens in zip(prefix.rows.cpu().tolist(), prefix.tokens.cpu().tolist(), strict=True):
        members = [r for r in rows if r >= 0]
        if not tokens:
            continue
        blocks = tokens // block_size
        if tokens % block_size or not members or rows[0] < 0:
            raise ValueError(f"group {rows}: {tokens} shared tokens are not whole blocks of a row")
        lead = tables[members[0], :blocks]
        for r in members:
            if not torch.equal(tables[r, :blocks], lead) or tokens >= int(lens[r]):
                raise ValueError(f"row {r} does not share its group's first {tokens} tokens")
            starts[r] = tokens
    if not torch.equal(starts, prefix.starts.cpu().to(starts.dtype)):
        raise ValueError("the rows' starts are not their groups' shared tokens")
