"""The graphed block copy of the CUDA IPC path (worker/transfer/ipc_copy.py).

On CPU only the bucketing runs; the copies need a GPU (CUDA graphs), where two tensors of one
process stand in for the connector's region and the peer's mapping (the connector's own GPU
tests write across processes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrail.worker.transfer.ipc_copy import MIN_BUCKET, GraphedBlockCopy, bucket


def test_block_counts_share_a_graph_per_power_of_two() -> None:
    assert [bucket(n) for n in (1, MIN_BUCKET, MIN_BUCKET + 1, 512, 513)] == [
        MIN_BUCKET, MIN_BUCKET, 2 * MIN_BUCKET, 512, 1024,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least one block"):
        bucket(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_copies_move_exactly_the_named_blocks_whatever_came_before() -> None:
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(-(2**62), 2**62, (600, 64), generator=gen).cuda()
    dst = torch.zeros(700, 64, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    copier = GraphedBlockCopy(src, dst, stream)
    rng = np.random.default_rng(0)
    # a long write, then shorter ones in the same bucket: none may repeat the earlier pairs
    for n in (120, 70, 65, 3, 511, 512):
        dst.zero_()
        torch.cuda.synchronize()
        src_ids = rng.choice(600, n, replace=False).astype(np.int64)
        dst_ids = rng.choice(700, n, replace=False).astype(np.int64)
        copier.copy(src_ids, dst_ids)
        stream.synchronize()
        expected = torch.zeros_like(dst)
        expected[torch.from_numpy(dst_ids).cuda()] = src[torch.from_numpy(src_ids).cuda()]
        assert torch.equal(dst, expected), n
    copier.close()
