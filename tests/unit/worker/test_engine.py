"""Engine API on a tiny random model: tenant isolation of the prefix cache, step outputs."""

from __future__ import annotations

import pytest

from kvrail.errors import InvalidRequestError
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.engine import LLMEngine
from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

PROMPT = list(range(3, 24))  # 5 full 4-token blocks


def _run(engine: LLMEngine, request_id: str, tenant: str) -> int:
    request = engine.add_request(
        request_id, PROMPT, SamplingParams(max_tokens=2), tenant_salt=tenant
    )
    while engine.has_unfinished_requests():
        engine.step()
    return int(request.num_cached_tokens)


def test_tenants_never_share_cached_prefixes_but_a_tenant_reuses_its_own() -> None:
    engine = make_engine(tiny_llama_config(), seed=1)
    assert _run(engine, "a1", tenant="alpha") == 0
    assert _run(engine, "b1", tenant="beta") == 0
    assert _run(engine, "none", tenant="") == 0
    assert _run(engine, "a2", tenant="alpha") == 20
    assert _run(engine, "none2", tenant="") == 20
    assert_engine_empty(engine)


def test_step_reports_each_new_token_and_the_finish_reason() -> None:
    engine = make_engine(tiny_llama_config(), seed=1)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [len(o.token_ids) for o in outputs] == [1, 1, 1]  # only the new token, each step
    assert [o.finished for o in outputs] == [False, False, True]
    assert outputs[-1].finish_reason == "length"
    assert engine.step() == []
    assert_engine_empty(engine)


def test_zero_kv_on_release_leaves_no_finished_request_in_memory() -> None:
    """`security.zeroKVOnRelease`: once a request finishes (or is aborted) every block it held
    is zero and out of the prefix cache, and the tokens are the same as without zeroing."""
    plain = make_engine(tiny_llama_config(), seed=1)
    zeroing = make_engine(tiny_llama_config(), seed=1, zero_kv_on_release=True)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outputs = []
    for engine in (plain, zeroing):
        engine.add_request("a", PROMPT, params)
        engine.add_request("b", PROMPT, params)  # the same prompt, at the same time
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                done.setdefault(o.request_id, []).extend(o.token_ids)
        outputs.append(done)
    assert outputs[0] == outputs[1]
    assert plain.kv_cache.tensor.abs().sum() > 0 and plain.cached_block_hashes()
    assert zeroing.kv_cache.tensor.abs().sum() == 0 and not zeroing.cached_block_hashes()
    # An aborted request's blocks are zeroed too, and a later request recomputes its prefix.
    zeroing.add_request("c", PROMPT, params)
    zeroing.step()
    assert zeroing.kv_cache.tensor.abs().sum() > 0
    assert zeroing.abort("c")
    assert zeroing.kv_cache.tensor.abs().sum() == 0
    assert _run(zeroing, "d", tenant="") == 0
    assert_engine_empty(zeroing)


def test_token_ids_the_model_does_not_have_are_refused_before_any_step() -> None:
    """One request's out-of-range id would fail the whole batch: it is refused at admission and
    the request beside it runs to its end."""
    engine = make_engine(tiny_llama_config(), seed=1)
    vocab = engine.model.shape.vocab_size
    beside = engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match="prompt token ids"):
        engine.add_request("bad", [5, vocab], SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.add_request("bad", [5], SamplingParams(max_tokens=3, stop_token_ids=(vocab + 7,)))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.reserve_remote("bad", [5], SamplingParams(max_tokens=3, stop_token_ids=(vocab,)))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(beside.output_token_ids) == 3
    assert_engine_empty(engine)
