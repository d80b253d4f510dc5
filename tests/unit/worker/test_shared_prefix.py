"""Grouping decode rows that share their first blocks (`find_shared_prefixes`): the groups it
returns hold exactly what the attention kernel's hint promises (checked by the kernels' own
check), rows that share most sit together, and a step that would save little gets none."""

from __future__ import annotations

import numpy as np
import torch

from kvrail.kernels.shared_prefix import SharedPrefixes, check_shared_prefixes
from kvrail.worker.engine.shared_prefix import MIN_SAVED, find_shared_prefixes


def _tables(rows: list[list[int]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    return np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)


def _check(tables: np.ndarray, lens: np.ndarray, bs: int) -> None:
    groups = find_shared_prefixes(tables, lens, bs)
    assert groups is not None
    arrays = (groups.rows, groups.tokens, groups.starts)
    hint = SharedPrefixes(*(torch.from_numpy(a) for a in arrays))
    check_shared_prefixes(hint, torch.from_numpy(tables), torch.from_numpy(lens), bs)


def test_the_choices_of_two_prompts_form_one_group_each_and_share_their_prompts_blocks() -> None:
    bs = 4
    prompt_a, prompt_b = [1, 2, 3, 4], [5, 6, 7, 8]  # 16 tokens each, whole blocks
    rows, lens = [], []
    for c in range(3):  # interleaved: a0 b0 a1 b1 a2 b2, each with its own tail blocks
        for p, prompt in enumerate((prompt_a, prompt_b)):
            rows.append(prompt + [100 + 10 * p + c, 200 + 10 * p + c])
            lens.append(16 + 5 + c)
    tables, seq_lens = _tables(rows), np.array(lens, dtype=np.int32)
    groups = find_shared_prefixes(tables, seq_lens, bs)
    assert groups is not None
    assert sorted(map(sorted, (r[r >= 0].tolist() for r in groups.rows))) == [[0, 2, 4], [1, 3, 5]]
    assert groups.tokens.tolist() == [16, 16]
    assert groups.starts.tolist() == [16] * 6
    assert groups.saved == 2 * 2 * 16
    _check(tables, seq_lens, bs)


def test_groups_hold_at_most_members_rows_and_never_a_rows_last_block() -> None:
    bs = 2
    shared = list(range(1, 6))
    rows = [shared + [50 + i] for i in range(11)]  # 11 rows: groups of 8 and 3
    rows.append(shared)  # its last token is in block 5 (shared[-1]): it shares 4 blocks
    lens = [12] * 11 + [9]
    tables, seq_lens = _tables(rows), np.array(lens, dtype=np.int32)
    groups = find_shared_prefixes(tables, seq_lens, bs, members=8)
    assert groups is not None
    sizes = sorted(int((r >= 0).sum()) for r in groups.rows)
    assert sizes == [4, 8]
    assert groups.starts[11] == 8  # 4 whole blocks, its last one its own
    _check(tables, seq_lens, bs)


def test_rows_that_share_little_get_no_groups() -> None:
    bs = 16
    rows = [[1] + list(range(10 * i + 2, 10 * i + 10)) for i in range(8)]  # one block in common
    seq_lens = np.full(8, 9 * bs, dtype=np.int32)
    assert 7 * bs < MIN_SAVED * seq_lens.sum()
    assert find_shared_prefixes(_tables(rows), seq_lens, bs) is None
    distinct = [[i + 1, i + 20] for i in range(8)]
    assert find_shared_prefixes(_tables(distinct), np.full(8, 20, np.int32), bs) is None
    assert find_shared_prefixes(_tables([[1, 2]]), np.array([20], np.int32), bs) is None


def test_random_batches_always_satisfy_the_kernels_check() -> None:
    rng = np.random.default_rng(7)
    bs = 4
    for _ in range(200):
        prompts = [list(rng.integers(1, 500, size=rng.integers(1, 6))) for _ in range(4)]
        rows, lens = [], []
        for _ in range(int(rng.integers(2, 40))):
            prompt = prompts[int(rng.integers(0, 4))][: int(rng.integers(1, 6))]
            tail = list(rng.integers(1000, 5000, size=int(rng.integers(1, 4))))
            rows.append(prompt + tail)
            lens.append(len(prompt) * bs + (len(tail) - 1) * bs + int(rng.integers(1, bs + 1)))
        tables, seq_lens = _tables(rows), np.array(lens, dtype=np.int32)
        groups = find_shared_prefixes(tables, seq_lens, bs)
        if groups is not None:
            _check(tables, seq_lens, bs)
            assert groups.saved >= MIN_SAVED * seq_lens.sum()
