"""The CUDA graphs' inputs: static device buffers, and pinned host buffers to stage them.

`cuda_graph.StepGraphs` replays graphs that read fixed device buffers; a step's host arrays are
written into one of two pinned staging sets and copied without waiting for the device. A set is
refilled only once the copies out of it (two replays ago) have run, so the engine can queue a
replay while the previous one runs. Padding is harmless by construction (see `cuda_graph`); the
shared prefixes of a "shared" decode graph pad with groups of no tokens and rows of -1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvrail.kernels.shared_prefix import SharedPrefixes
from kvrail.worker.engine.shared_prefix import MEMBERS, PrefixGroups


def empty_prefixes(seqs: int, **where: Any) -> SharedPrefixes:
    """Shared-prefix buffers for `seqs` rows, holding no group: at most `seqs // 2` groups (two
    rows a group at least) of `MEMBERS` rows of -1 and no tokens, every row's start 0. `where`:
    torch's `device=` or `pin_memory=`."""
    groups = seqs // 2
    return SharedPrefixes(
        torch.full((groups, MEMBERS), -1, dtype=torch.int32, **where),
        torch.zeros(groups, dtype=torch.int32, **where),
        torch.zeros(seqs, dtype=torch.int32, **where),
    )


class GraphInputs:
    """The graphs' static device buffers and two sets of pinned staging buffers, in turn."""

    def __init__(
        self, tokens: int, seqs: int, max_blocks: int, tiles: int, device: torch.device
    ) -> None:
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(seqs, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.tiles = torch.full((2, tiles), -1, dtype=torch.int32, device=device)
        self.prefix = empty_prefixes(seqs, device=device)
        self._staging = tuple(Staging(tokens, seqs, max_blocks, tiles) for _ in range(2))
        self._turn = 0

    def stage(self) -> Staging:
        """The next staging set, once the copies out of it (two replays ago) have run."""
        staging = self._staging[self._turn]
        self._turn ^= 1
        staging.copied.synchronize()
        return staging

    def copy(
        self,
        staging: Staging,
        tokens: int,
        seqs: int,
        width: int,
        with_tiles: bool,
        with_prefix: bool = False,
    ) -> None:
        """Queue the copies of `staging`'s first `tokens` tokens and `seqs` sequences (tables
        `width` wide), the query starts and tile maps for a mixed graph, and the shared prefixes
        for a "shared" decode graph."""
        self.input_ids[:tokens].copy_(staging.ids[0, :tokens], non_blocking=True)
        self.positions[:tokens].copy_(staging.ids[1, :tokens], non_blocking=True)
        self.slot_mapping[:tokens].copy_(staging.ids[2, :tokens], non_blocking=True)
        self.seq_lens[:seqs].copy_(staging.lens[:seqs], non_blocking=True)
        tables = staging.tables[: seqs * width].view(seqs, width)
        self.block_tables[:seqs, :width].copy_(tables, non_blocking=True)
        if with_tiles:
            self.query_start_loc[: seqs + 1].copy_(staging.start_loc[: seqs + 1],
                                                   non_blocking=True)  # fmt: skip
            self.tiles.copy_(staging.tiles, non_blocking=True)
        if with_prefix:
            sizes = (seqs // 2, seqs // 2, seqs)  # rows and tokens per group, starts per row
            for device, host, size in zip(self.prefix, staging.prefix, sizes, strict=True):
                device[:size].copy_(host[:size], non_blocking=True)
        staging.copied.record()


class Staging:
    """Pinned host buffers for one replay's inputs, and an event recorded after their copies."""

    def __init__(self, tokens: int, seqs: int, max_blocks: int, tiles: int) -> None:
        self.ids = torch.zeros(3, tokens, dtype=torch.int64, device="cpu", pin_memory=True)
        self.lens = torch.ones(seqs, dtype=torch.int32, device="cpu", pin_memory=True)
        self.tables = torch.zeros(seqs * max_blocks, dtype=torch.int32, device="cpu",
                                  pin_memory=True)  # fmt: skip
        self.start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device="cpu", pin_memory=True)
        self.tiles = torch.full((2, tiles), -1, dtype=torch.int32, device="cpu", pin_memory=True)
        self.prefix = empty_prefixes(seqs, pin_memory=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def fill_tokens(
        self,
        n: int,
        padded: int,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
    ) -> None:
        """Tokens 0..n-1, then padding up to `padded` that writes no KV."""
        host = self.ids.numpy()
        host[0, :n] = input_ids
        host[1, :n] = positions
        host[2, :n] = slot_mapping
        host[:, n:padded] = 0
        host[2, n:padded] = -1

    def fill_sequences(
        self, n: int, padded: int, seq_lens: np.ndarray, block_tables: list[np.ndarray]
    ) -> None:
        """Sequences 0..n-1 (their tables stacked from `block_tables`, padded with the null
        block to the widest), then padding up to `padded`: length 1 over the null block."""
        width = max(t.shape[1] for t in block_tables)
        lens = self.lens.numpy()
        lens[:n] = seq_lens
        lens[n:padded] = 1
        rows = self.tables[: padded * width].numpy().reshape(padded, width)
        rows[:] = 0
        row = 0
        for table in block_tables:
            rows[row : row + table.shape[0], : table.shape[1]] = table
            row += table.shape[0]

    def fill_prefix(self, n: int, padded: int, shared: PrefixGroups) -> None:
        """`shared`'s groups of rows 0..n-1, then empty groups and rows up to `padded` rows."""
        rows, tokens, starts = (t.numpy() for t in self.prefix)
        count = shared.num_groups
        rows[:count] = shared.rows
        rows[count : padded // 2] = -1
        tokens[:count] = shared.tokens
        tokens[count : padded // 2] = 0
        starts[:n] = shared.starts
        starts[n:padded] = 0
