"""Which decode rows of a step share their first KV blocks, for attention to read them once.

The `n` choices of a request share its prompt's full blocks (one prefill; each choice has its
own blocks after them), and so do requests whose system prompt the prefix cache holds. A decode
step reads every row's whole context, so 8 choices of a 512-token prompt read the prompt's K and
V 8 times a layer. `find_shared_prefixes` groups such rows (at most `MEMBERS` a group) for
`kvrail.kernels.prefix_attention`, which reads the shared blocks once per group.

Rows are ordered by their block tables, so rows that share the longest prefixes sit side by
side; consecutive rows with the same first block form groups of up to `MEMBERS`, and a group
shares the whole blocks every member has in common with its first, short of each member's last
token (a row attends its own tail, so no row shares all its context). A step gets groups only
when they save at least `MIN_SAVED` of the tokens its attention reads: below that the extra merge
costs about what it saves. Pure numpy over the step's host arrays, vectorised: no loop over rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MEMBERS = 8  # rows a group: a prompt's 8 choices under Llama-3's GQA of 4 fill a 32-row dot
MIN_SAVED = 0.2  # of the tokens a step's attention reads


@dataclass(frozen=True, slots=True)
class PrefixGroups:
    """`kvrail.kernels.shared_prefix.SharedPrefixes` as host arrays: `rows` int32 [G, MEMBERS]
    (-1: none), `tokens` int32 [G], `starts` int32 [S], and the tokens a step no longer reads
    (`saved`)."""

    rows: np.ndarray
    tokens: np.ndarray
    starts: np.ndarray
    saved: int

    @property
    def num_groups(self) -> int:
        return int(self.rows.shape[0])


def find_shared_prefixes(
    block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int, members: int = MEMBERS
) -> PrefixGroups | None:
    """Groups of decode rows (block_tables int32 [S, W] padded with block 0, seq_lens [S]) that
    share whole leading blocks, or None when no grouping saves `MIN_SAVED` of the step's reads."""
    num_rows = len(seq_lens)
    if num_rows < 2 or members < 2:
        return None
    first = block_tables[:, 0]
    if np.unique(first).size == num_rows:  # the common case: nothing shared, nothing sorted
        return None
    order = np.lexsort(block_tables.T[::-1])  # rows with the longest common prefixes adjacent
    tables = block_tables[order]
    new_run = np.r_[True, tables[1:, 0] != tables[:-1, 0]]
    run_start = np.maximum.accumulate(np.where(new_run, np.arange(num_rows), 0))
    position = np.arange(num_rows) - run_start  # within its run of one first block
    new_group = (position % members) == 0
    leader = np.maximum.accumulate(np.where(new_group, np.arange(num_rows), 0))
    common = np.cumprod(tables == tables[leader], axis=1).sum(axis=1)
    own = (seq_lens[order].astype(np.int64) - 1) // block_size  # blocks before its last token
    starts_at = np.flatnonzero(new_group)
    shared = np.minimum.reduceat(np.minimum(common, own), starts_at)
    sizes = np.diff(np.r_[starts_at, num_rows])
    keep = (sizes >= 2) & (shared >= 1)
    saved = int(((sizes - 1) * shared)[keep].sum()) * block_size
    if not keep.any() or saved < MIN_SAVED * float(seq_lens.sum()):
        return None
    group_of = np.cumsum(new_group) - 1  # each ordered row's group, before dropping
    kept_index = np.cumsum(keep) - 1  # a kept group's index among the kept
    in_kept = keep[group_of]
    rows = np.full((int(keep.sum()), members), -1, dtype=np.int32)
    tokens = (shared[keep] * block_size).astype(np.int32)
    member = np.arange(num_rows) - leader
    rows[kept_index[group_of[in_kept]], member[in_kept]] = order[in_kept]
    starts = np.zeros(num_rows, dtype=np.int32)
    starts[order[in_kept]] = tokens[kept_index[group_of[in_kept]]]
    return PrefixGroups(rows, tokens, starts, saved)
