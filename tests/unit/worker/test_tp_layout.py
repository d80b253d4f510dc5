"""The tensor-parallel split: which heads, columns and vocabulary rows each rank holds, which sizes
a model refuses (with the sizes that would work), and that the ranks' shards of real weights put
back together are the weights (pure arithmetic and weight loading; no process, no collective)."""

from __future__ import annotations

import pytest
import torch

from kvrail.errors import ConfigError
from kvrail.worker.models.llama import LlamaForCausalLM
from kvrail.worker.parallel.group import TpGroup
from kvrail.worker.parallel.layout import TpLayout, check_tensor_parallel_size
from kvrail.worker.testing import tiny_llama_config


def layouts(size: int, heads: int, kv_heads: int, inter: int = 96, vocab: int = 97) -> list:
    return [TpLayout(r, size, heads, kv_heads, inter, vocab) for r in range(size)]


@pytest.mark.parametrize(
    "size,heads,kv_heads,expected_kv",
    [
        (2, 8, 4, [(0, 2), (2, 2)]),
        (4, 8, 4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
        (4, 8, 2, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # fewer KV heads than ranks: replicated
        (8, 8, 1, [(0, 1)] * 8),  # multi-query attention: one head on every rank
        (3, 9, 3, [(0, 1), (1, 1), (2, 1)]),  # SmolLM2-135M
    ],
)
def test_each_rank_holds_the_kv_heads_its_query_heads_read(
    size: int, heads: int, kv_heads: int, expected_kv: list[tuple[int, int]]
) -> None:
    ranks = layouts(size, heads, kv_heads)
    assert [(r.kv_head_start, r.num_local_kv_heads) for r in ranks] == expected_kv
    group = heads // kv_heads  # query heads per KV head
    for r in ranks:
        assert r.num_local_heads == heads // size
        read = {q // group for q in range(r.head_start, r.head_start + r.num_local_heads)}
        assert read <= set(range(r.kv_head_start, r.kv_head_start + r.num_local_kv_heads))
    assert sorted(q for r in ranks for q in range(r.head_start, r.head_start + r.num_local_heads)) \
        == list(range(heads))  # fmt: skip


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_vocabulary_rows_cover_the_vocabulary_once_and_pad_the_last_rank(size: int) -> None:
    ranks = layouts(size, 24, 24, inter=24, vocab=97)
    rows = [v for r in ranks for v in range(r.vocab_start, r.vocab_end)]
    assert rows == list(range(97))
    assert all(r.padded_vocab_per_rank == -(-97 // size) for r in ranks)


@pytest.mark.parametrize(
    "size,heads,kv_heads,inter,message",
    [
        (2, 9, 3, 1536, "does not divide the model's 9 attention heads; sizes that work: 1, 3"),
        (4, 12, 6, 96, "does not divide the model's 6 KV heads; sizes that work: 1, 2, 3, 6"),
        (4, 8, 3, 96, "KV heads do not divide it"),
        (2, 8, 4, 33, "does not divide the model's intermediate size 33"),
        (16, 16, 16, 96, "outside 1..8"),
        (0, 8, 4, 96, "outside 1..8"),
    ],
)
def test_a_model_that_cannot_split_is_refused_with_the_sizes_that_work(
    size: int, heads: int, kv_heads: int, inter: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_tensor_parallel_size(size, heads, kv_heads, inter)


def _hf_state(**overrides: object) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM as HfLlama

    torch.manual_seed(5)
    return HfLlama(tiny_llama_config(**overrides)).state_dict()


@pytest.mark.parametrize(
    "size,overrides",
    [
        (2, {"num_attention_heads": 4, "num_key_value_heads": 2}),
        (4, {"num_attention_heads": 4, "num_key_value_heads": 2}),  # KV heads replicated
        (2, {"num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True}),
    ],
)
def test_the_shards_of_real_weights_put_back_together_are_the_weights(
    size: int, overrides: dict[str, object]
) -> None:
    state = _hf_state(**overrides)
    config = tiny_llama_config(**overrides)
    shards = []
    for rank in range(size):
        model = LlamaForCausalLM(config, TpGroup(rank, size))
        model.load_weights(state)
        shards.append(dict(model.named_parameters()))
    full = LlamaForCausalLM(config)
    full.load_weights(state)
    expected = dict(full.named_parameters())
    vocab = config.vocab_size
    embed = torch.cat([s["embed_tokens.weight"] for s in shards])
    assert torch.equal(embed[:vocab], expected["embed_tokens.weight"])
    assert not embed[vocab:].any()  # padding rows are zero
    o_proj = torch.cat([s["layers.1.o_proj.weight"] for s in shards], dim=1)
    assert torch.equal(o_proj, expected["layers.1.o_proj.weight"])
    down = torch.cat([s["layers.0.down_proj.weight"] for s in shards], dim=1)
    assert torch.equal(down, expected["layers.0.down_proj.weight"])
    head = config.hidden_size // config.num_attention_heads
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    q_rows = torch.cat([s["layers.0.qkv_proj.weight"][: heads // size * head] for s in shards])
    assert torch.equal(q_rows, state["model.layers.0.self_attn.q_proj.weight"])
    k_full = state["model.layers.0.self_attn.k_proj.weight"]
    for rank, s in enumerate(shards):
        layout = TpLayout(rank, size, heads, kv_heads, config.intermediate_size, vocab)
        q_local, kv_local = layout.num_local_heads * head, layout.num_local_kv_heads * head
        k_rows = s["layers.0.qkv_proj.weight"][q_local : q_local + kv_local]
        start = layout.kv_head_start * head
        assert torch.equal(k_rows, k_full[start : start + kv_local])
    gate_full = state["model.layers.0.mlp.gate_proj.weight"]
    gates = torch.cat([s["layers.0.gate_up_proj.weight"][: 48 // size] for s in shards])
    assert torch.equal(gates, gate_full)


def test_a_weight_of_the_wrong_size_is_refused_not_silently_cut() -> None:
    state = _hf_state()
    state["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(32, 40)
    model = LlamaForCausalLM(tiny_llama_config(), TpGroup(0, 2))
    with pytest.raises(ConfigError, match="o_proj"):
        model.load_weights(state)


def test_a_collective_of_a_group_that_never_joined_raises() -> None:
    with pytest.raises(RuntimeError, match="not joined"):
        TpGroup(1, 2).all_reduce(torch.ones(2))
