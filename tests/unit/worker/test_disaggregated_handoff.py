"""Prefill on one engine, decode on another: the decode engine reserves blocks (reusing its own
cached prefix), the prefill engine computes the prompt and retains its blocks, the blocks are
packed, moved and unpacked into the reservation, and the decode engine continues exactly as
transformers would. Both engines end empty."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrail.kernels import reference
from kvrail.sampling import SamplingParams
from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config


def _hf_model() -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(11)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def test_kv_moved_between_engines_decodes_like_transformers() -> None:
    hf = _hf_model()
    state = hf.state_dict()
    prefill = make_engine(tiny_llama_config(), state, num_blocks=64)
    decode = make_engine(tiny_llama_config(), state, num_blocks=40)
    prompt = list(range(5, 44))  # 39 tokens: 9 full 4-token blocks and a partial one
    # The decode engine already served a request sharing the first 8 tokens: cached locally.
    decode.generate([prompt[:9]], SamplingParams(max_tokens=1))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    reservation = decode.reserve_remote("r", prompt, params)
    assert reservation is not None and reservation.num_cached_tokens == 8
    assert decode.step() == []  # reserved, not runnable: nothing is scheduled

    job = prefill.add_request("r", prompt, SamplingParams(max_tokens=1), retain_blocks=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    first_token = job.output_token_ids[0]
    skip = reservation.num_cached_tokens // 4
    src = torch.tensor(prefill.retained_block_ids("r")[skip:])
    dst = torch.tensor(reservation.block_ids[skip:])
    assert len(src) == len(dst) == 8
    packed = reference.gather_blocks(prefill.kv_cache.tensor, src)
    reference.scatter_blocks(packed, decode.kv_cache.tensor, dst)
    prefill.release("r")

    decode.install_remote("r", first_token)
    request = decode.scheduler.requests["r"]
    while decode.has_unfinished_requests():
        decode.step()
    expected = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert request.output_token_ids == expected
    assert_engine_empty(prefill)
    assert_engine_empty(decode)


def test_retained_blocks_outlive_the_request_until_released_or_aborted() -> None:
    engine = make_engine(tiny_llama_config(), seed=2)
    free_before = engine.scheduler.kv_cache_manager.block_pool.num_free_blocks
    for start, request_id in ((3, "released"), (30, "aborted")):
        prompt = list(range(start, start + 11))  # 3 blocks each, no shared prefix
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=1), retain_blocks=True)
        while engine.has_unfinished_requests():
            engine.step()
        assert len(engine.retained_block_ids(request_id)) == 3
    assert engine.scheduler.kv_cache_manager.block_pool.num_free_blocks == free_before - 6
    engine.release("released")
    assert engine.abort("aborted")
    with pytest.raises(KeyError):
        engine.release("released")
    assert_engine_empty(engine)
