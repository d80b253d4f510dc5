"""Decode CUDA graphs: batch-size ladder on any machine; on a GPU, replayed decode steps give the
same tokens as eager ones (mixed batch sizes, padding rows, preemption-free)."""

from __future__ import annotations

import pytest
import torch

from kvrail.worker.engine.cuda_graph import graph_batch_sizes


def test_graph_batch_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-2:] == [240, 256]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_gives_the_same_tokens_as_eager_decode() -> None:
    from kvrail.sampling import SamplingParams
    from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

    def run(enable: bool) -> list[list[int]]:
        with torch.device("cuda"):
            engine = make_engine(
                tiny_llama_config(), seed=5, enable_cuda_graphs=enable, max_num_seqs=20
            )
        prompts = [list(range(5, 5 + n)) for n in (3, 17, 9, 30, 1)]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        assert_engine_empty(engine)
        return outputs

    assert run(enable=True) == run(enable=False)
