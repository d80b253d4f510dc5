"""CUDA graphs: the batch-size and token-count ladders and the choice of graph on any machine; on a
GPU, replayed decode and mixed steps give the same tokens as eager ones (mixed batch sizes,
padding rows and tiles, chunked prompts beside decodes, prefix cache hits)."""

from __future__ import annotations

import pytest
import torch

from kvrail.worker.engine.cuda_graph import (
    graph_batch_sizes,
    mixed_token_sizes,
    warm_eager_kernels,
)
from kvrail.worker.engine.model_runner import choose_graph


def test_graph_batch_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-2:] == [240, 256]


def test_mixed_token_sizes_reach_the_step_budget_or_the_largest_mixed_graph() -> None:
    assert mixed_token_sizes(40) == [16, 32, 40]
    assert mixed_token_sizes(700) == [16, 32, 64, 128, 256, 512, 700]
    assert mixed_token_sizes(2048)[-3:] == [1536, 1792, 2048]
    assert mixed_token_sizes(0) == []


def test_a_step_replays_the_graph_it_fits_and_runs_eagerly_otherwise() -> None:
    limits = (256, 2048, 256)  # decode batch, mixed tokens, mixed requests
    assert choose_graph(64, 0, 64, limits) == "decode"
    assert choose_graph(300, 0, 300, limits) == ""  # more decodes than the largest graph
    assert choose_graph(0, 0, 0, limits) == ""  # an empty step
    assert choose_graph(64, 1, 664, limits) == "mixed"
    assert choose_graph(0, 3, 1800, limits) == "mixed"  # prefill only
    assert choose_graph(10, 1, 2049, limits) == ""  # past the largest mixed graph
    assert choose_graph(250, 7, 300, limits) == ""  # more requests than its tables hold
    assert choose_graph(64, 1, 664, (0, 0, 0)) == ""  # no graphs captured


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_graphs_give_the_same_tokens_as_eager_mixed_steps(monkeypatch) -> None:
    """Prompts chunked under a 64-token budget, beside running decodes, one a prefix cache hit
    of another: the mixed graphs replay (counted) and the tokens equal the eager engine's."""
    from kvrail.sampling import SamplingParams
    from kvrail.worker.engine.cuda_graph import StepGraphs
    from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

    replays = []
    run_mixed = StepGraphs.run_mixed

    def counted(self, *args, **kwargs):
        replays.append(args[0].num_tokens + args[1].num_tokens)
        return run_mixed(self, *args, **kwargs)

    monkeypatch.setattr(StepGraphs, "run_mixed", counted)
    long = [1 + i % 90 for i in range(150)]  # the tiny model's vocabulary has 97 tokens
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 90, 1)] + [long, [*long, 3, 4, 5]]

    def run(enable: bool) -> list[list[int]]:
        with torch.device("cuda"):
            engine = make_engine(
                tiny_llama_config(), seed=5, enable_cuda_graphs=enable, max_num_seqs=20,
                max_num_batched_tokens=64, num_blocks=200,
            )  # fmt: skip
        outputs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        assert_engine_empty(engine)
        return outputs

    eager = run(enable=False)
    assert run(enable=True) == eager
    assert replays and max(replays) <= 64 and min(replays) < 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_prefix_decode_gives_the_same_tokens_replayed_and_eager(monkeypatch) -> None:
    """Six requests of one 150-token prompt (five of them prefix-cache hits, as `n` choices are)
    beside two others: their decode steps replay the "shared" graphs (counted) or run eagerly over
    the shared blocks, and the tokens equal an engine's that reads every row's whole context."""
    from kvrail.sampling import SamplingParams
    from kvrail.worker.engine.cuda_graph import StepGraphs
    from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

    replays: list[bool] = []
    run_decode = StepGraphs.run

    def counted(self, *args, **kwargs):
        replays.append(len(args) > 6 and args[6] is not None)
        return run_decode(self, *args, **kwargs)

    monkeypatch.setattr(StepGraphs, "run", counted)
    long = [1 + i % 90 for i in range(150)]  # the tiny model's vocabulary has 97 tokens

    def run(graphs: bool, shared: bool) -> list[list[int]]:
        with torch.device("cuda"):
            engine = make_engine(
                tiny_llama_config(), seed=5, enable_cuda_graphs=graphs, max_num_seqs=20,
                num_blocks=200, shared_prefix_decode=shared,
            )  # fmt: skip
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=3)
        lead = engine.add_request("lead", long, params)
        while not lead.num_output_tokens:
            engine.step()
        requests = [lead] + [
            engine.add_request(f"r{i}", prompt, params)
            for i, prompt in enumerate([long] * 5 + [list(range(5, 25)), [7, 8, 9]])
        ]
        while engine.has_unfinished_requests():
            engine.step()
        assert_engine_empty(engine)
        return [r.output_token_ids for r in requests]

    plain = run(graphs=True, shared=False)
    assert not any(replays)
    assert run(graphs=True, shared=True) == plain
    assert any(replays)
    assert run(graphs=False, shared=True) == plain
