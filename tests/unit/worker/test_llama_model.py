"""Our Llama-family model equals transformers on tiny random-weight configs of each variant:
Llama (GQA), Llama 3 RoPE scaling, Qwen2 (QKV bias), Mistral, tied embeddings."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrail.errors import ConfigError
from kvrail.sampling import SamplingParams
from kvrail.worker.models.llama import LlamaForCausalLM
from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}


def _variant(name: str) -> Any:
    from transformers import MistralConfig, Qwen2Config

    base = tiny_llama_config().to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        base.pop(key, None)
    if name == "llama":
        return tiny_llama_config()
    if name == "llama3 rope scaling, tied embeddings":
        return tiny_llama_config(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)
    if name == "qwen2 qkv bias":
        return Qwen2Config(**base)
    if name == "mistral":
        return MistralConfig(**{**base, "sliding_window": None})
    raise AssertionError(name)


def _hf_model(config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-zero biases, so a dropped bias cannot go unnoticed
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    return model


VARIANTS = ["llama", "llama3 rope scaling, tied embeddings", "qwen2 qkv bias", "mistral"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_equals_transformers_for_each_variant(variant: str) -> None:
    config = _variant(variant)
    hf = _hf_model(config)
    if variant.startswith("qwen2"):
        assert any(n.endswith("q_proj.bias") for n, _ in hf.named_parameters())
    engine = make_engine(config, hf.state_dict(), max_num_batched_tokens=16)
    prompts = [list(range(5, 12)), [20, 21, 22], list(range(30, 70))]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert output == expected, f"prompt of {len(prompt)} tokens diverged"
    assert_engine_empty(engine)


def test_prefill_logits_match_transformers_within_float32_tolerance() -> None:
    config = _variant("llama3 rope scaling, tied embeddings")
    hf = _hf_model(config)
    engine = make_engine(config, hf.state_dict(), max_num_batched_tokens=64)
    prompt = list(range(3, 40))
    engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    logits, _, _ = engine.runner.execute(out)
    engine.scheduler.update_from_output(out, {"r": 0})
    expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
    assert_engine_empty(engine)


def test_unsupported_configs_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="model_type"):
        LlamaForCausalLM(type("C", (), {"model_type": "gpt2"})())
    with pytest.raises(ConfigError, match="rope type"):
        LlamaForCausalLM(
            tiny_llama_config(
                rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}
            )
        )


def test_load_weights_refuses_a_state_dict_with_missing_weights() -> None:
    config = tiny_llama_config()
    state = _hf_model(config).state_dict()
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ConfigError, match="qkv_proj"):
        LlamaForCausalLM(config).load_weights(state)


def test_outputs_survive_preemption_by_recompute_unchanged() -> None:
    config = _variant("llama")
    hf = _hf_model(config)
    # 9 usable 4-token blocks for three requests growing to 7 blocks each: preemption is certain.
    engine = make_engine(config, hf.state_dict(), num_blocks=10, max_num_batched_tokens=16)
    prompts = [list(range(5, 17)), list(range(40, 50)), list(range(60, 71))]
    requests = [
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=14, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
    assert sum(r.num_preemptions for r in requests) > 0
    for prompt, request in zip(prompts, requests, strict=True):
        expected = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=14,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert request.output_token_ids == expected
    assert_engine_empty(engine)
