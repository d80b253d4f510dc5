"""Decode CUDA graphs: batch-size ladder on any machine; on a GPU, replayed decode steps give the
same tokens as eager ones (mixed batch sizes, padding rows, preemption-free)."""

from __future__ import annotations

import pytest
import torch

from kvrail.worker.engine.cuda_graph import graph_batch_sizes, warm_eager_kernels


def test_graph_batch_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-2:] == [240, 256]


def test_the_eager_warm_up_writes_no_kv_and_changes_no_answer() -> None:
    """It runs on the CPU's reference kernels too: the same forwards, nothing written."""
    from kvrail.sampling import SamplingParams
    from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = make_engine(tiny_llama_config(), seed=5, max_num_seqs=6).generate(prompts, params)
    engine = make_engine(tiny_llama_config(), seed=5, max_num_seqs=6)
    cache = engine.kv_cache.tensor
    cache.fill_(0.5)  # every block, the null block 0 included, holds a known value
    warm_eager_kernels(engine.runner.model, engine.kv_cache, 6, 8)
    assert bool((cache == 0.5).all()), "the warm-up wrote KV"
    cache.zero_()
    assert engine.generate(prompts, params) == expected
    assert_engine_empty(engine)


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
