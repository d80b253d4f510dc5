"""The KV cache's own dtype (`kv_dtype`): FP8 and the other float types on CPU, through the torch
reference kernels; on CUDA the weights' dtype or FP8 (the Triton kernels' FP8 paths are tested
against these references on a GPU, tests/unit/kernels/test_fp8_kernels.py).

FP8 accuracy is measured, not asserted here (bench/engine/fp8_accuracy.py).
These tests pin what must hold exactly: the bytes written are the saturating rounding of K and V,
attention reads back exactly those values, the fingerprint (so pairing and block hashes) follows
the KV dtype, blocks move between engines as bytes, and freed blocks are zeroed in any dtype."""

from __future__ import annotations

import pytest
import torch

from kvrail.errors import ConfigError
from kvrail.kernels import reference
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.config import EngineConfig, kv_cache_dtype
from kvrail.worker.ranks.spec import RankSpec
from kvrail.worker.testing import assert_engine_empty, make_engine, tiny_llama_config

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
PROMPTS = [list(range(5, 40)), [20, 21, 22], list(range(30, 90))]


def gpu_of(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str) -> None:
    """Stand in for a CUDA device of `capability` (this machine has none): only the two
    queries the refusals make are answered."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)


def test_kv_cache_dtype_is_the_models_or_fp8_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kv_cache_dtype("auto", torch.bfloat16, "cuda") is torch.bfloat16
    assert kv_cache_dtype("bfloat16", torch.bfloat16, "cuda") is torch.bfloat16
    assert kv_cache_dtype("float8_e4m3fn", torch.float32, "cpu") is torch.float8_e4m3fn
    assert kv_cache_dtype("float16", torch.float32, "cpu") is torch.float16
    with pytest.raises(ConfigError, match="CUDA kernels read a KV cache in the weights' dtype"):
        kv_cache_dtype("float16", torch.bfloat16, "cuda")
    gpu_of(monkeypatch, (9, 0), "NVIDIA H200")
    assert kv_cache_dtype("float8_e4m3fn", torch.bfloat16, "cuda") is torch.float8_e4m3fn
    assert kv_cache_dtype("float8_e5m2", torch.float16, "cuda") is torch.float8_e5m2
    gpu_of(monkeypatch, (8, 0), "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"kv_dtype float8_e4m3fn on NVIDIA A100 .*8\.9"):
        kv_cache_dtype("float8_e4m3fn", torch.bfloat16, "cuda")
    with pytest.raises(ConfigError, match="not auto or one of"):
        kv_cache_dtype("int8", torch.float32, "cpu")
    with pytest.raises(ConfigError, match="kv_dtype 'fp8' is not auto"):
        EngineConfig(num_blocks=4, kv_dtype="fp8")
    with pytest.raises(ValueError, match="caches KV in fp8"):
        RankSpec(1, 2, "smollm2", "float32", "cpu", 4, 4, 1, kv_dtype="fp8")


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_writing_fp8_rounds_and_saturates_and_attention_reads_exactly_those_values(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(0)
    limit = torch.finfo(dtype).max
    key = torch.randn(6, 2, 8) * 3
    key[0, 0, 0], key[1, 1, 1] = 10 * limit, -10 * limit  # beyond the format: saturate
    key[2, 0, 3] = float("nan")
    value = torch.randn(6, 2, 8)
    caches = [torch.zeros(4, 4, 2, 8, dtype=dtype) for _ in range(2)]
    slots = torch.tensor([0, 1, 2, 5, 6, 13])
    reference.write_kv(key, value, caches[0], caches[1], slots)
    written = caches[0].float().reshape(-1, 2, 8)[slots]
    assert written[0, 0, 0] == limit and written[1, 1, 1] == -limit
    assert torch.isnan(written[2, 0, 3])
    finite = ~torch.isnan(key) & (key.abs() < limit)
    assert torch.equal(written[finite], key.to(dtype).float()[finite])  # round to nearest

    # Attention over the FP8 cache equals attention over a float32 cache holding its values.
    key[2, 0, 3] = 0.0
    reference.write_kv(key, value, caches[0], caches[1], slots)
    wide = [c.float() for c in caches]
    query = torch.randn(2, 4, 8)
    tables = torch.tensor([[0, 1], [1, 3]])
    seq_lens = torch.tensor([6, 7])
    got = reference.paged_decode_attention(query, *caches, tables, seq_lens, 0.35)
    expected = reference.paged_decode_attention(query, *wide, tables, seq_lens, 0.35)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_an_engine_caches_kv_in_its_kv_dtype_and_its_fingerprint_says_so(kv_dtype: str) -> None:
    base = make_engine(tiny_llama_config())
    engine = make_engine(tiny_llama_config(), kv_dtype=kv_dtype, zero_kv_on_release=True)
    itemsize = torch.empty((), dtype=engine.kv_cache.tensor.dtype).element_size()
    assert str(engine.kv_cache.tensor.dtype) == f"torch.{kv_dtype}"
    assert engine.kv_cache.nbytes * 4 == base.kv_cache.nbytes * itemsize  # base: float32
    assert engine.fingerprint.dtype == "float32" and engine.fingerprint.kv_dtype == kv_dtype
    assert engine.fingerprint.digest != base.fingerprint.digest  # never pair, never share hashes
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o) for o in outputs] == [12, 12, 12]
    assert not engine.kv_cache.tensor.view(torch.uint8).any()  # released blocks were zeroed
    assert_engine_empty(engine)


def test_a_fingerprint_unlike_the_engines_kv_dtype_is_refused() -> None:
    from kvrail.worker.engine.engine import LLMEngine
    from kvrail.worker.models.llama import LlamaForCausalLM

    engine = make_engine(tiny_llama_config())
    model = LlamaForCausalLM(tiny_llama_config())
    model.init_random(0)
    config = EngineConfig(num_blocks=16, block_size=4, kv_dtype="float8_e4m3fn")
    with pytest.raises(ConfigError, match="fingerprint kv_dtype=float32 but the engine caches"):
        LLMEngine(model, config, engine.fingerprint)


def test_fp8_blocks_moved_between_engines_decode_like_the_colocated_fp8_engine() -> None:
    """The handoff moves a block's bytes: the decode engine continues exactly as one engine with
    the same FP8 cache would (the colocated baseline), not as a float32 one."""
    prompt = list(range(5, 44))  # 9 full 4-token blocks and a partial one
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    colocated = make_engine(tiny_llama_config(), kv_dtype="float8_e4m3fn")
    expected = colocated.generate([prompt], params)[0]
    prefill = make_engine(tiny_llama_config(), kv_dtype="float8_e4m3fn")
    decode = make_engine(tiny_llama_config(), kv_dtype="float8_e4m3fn", num_blocks=40)
    reservation = decode.reserve_remote("r", prompt, params)
    assert reservation is not None and reservation.num_cached_tokens == 0
    job = prefill.add_request("r", prompt, SamplingParams(max_tokens=1), retain_blocks=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    src = torch.tensor(prefill.retained_block_ids("r"))
    packed = reference.gather_blocks(prefill.kv_cache.tensor, src)
    assert packed.dtype == torch.float8_e4m3fn
    reference.scatter_blocks(packed, decode.kv_cache.tensor, torch.tensor(reservation.block_ids))
    prefill.release("r")
    decode.install_remote("r", job.output_token_ids[0])
    request = decode.scheduler.requests["r"]
    while decode.has_unfinished_requests():
        decode.step()
    assert request.output_token_ids == expected
    for engine in (colocated, prefill, decode):
        assert_engine_empty(engine)


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_a_long_fresh_prompt_over_an_e4m3_cache_attends_in_fp8_through_its_output_projection(
    monkeypatch: pytest.MonkeyPatch, quantization: str
) -> None:
    """A 4,096-token prompt over an e4m3 cache attends in FP8 in every layer (the CPU reference:
    float32 over the e4m3 q, k and v, the output rounded to e4m3 rows), and those rows go to
    the output projection: as they are into FP8 weights, widened for float ones. Its prefill
    logits stay near the same engine's attending in float32 over the same cache."""
    from transformers import AutoModelForCausalLM

    from kvrail.kernels import dispatch
    from kvrail.worker.engine.engine import LLMEngine, make_fingerprint
    from kvrail.worker.models import llama
    from kvrail.worker.testing import make_engine_config

    hf_config = tiny_llama_config(max_position_embeddings=4352)
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(hf_config).eval()
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    prompt = [
        int(t) for t in torch.randint(3, 97, (4096,), generator=torch.Generator().manual_seed(8))
    ]
    calls: list[int] = []
    fp8_attention = dispatch.fp8_causal_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return fp8_attention(*args, **kwargs)

    monkeypatch.setattr(dispatch, "fp8_causal_attention", counted)

    def prefill_logits() -> torch.Tensor:
        model = llama.LlamaForCausalLM.build(
            hf_config, state, dtype=torch.float32, device="cpu", quantization=quantization
        )
        config = make_engine_config(
            kv_dtype="float8_e4m3fn", block_size=16, num_blocks=300, max_model_len=4352,
            max_num_batched_tokens=4096,
        )  # fmt: skip
        engine = LLMEngine(model, config, make_fingerprint(model, config, "w", "t"))
        engine.add_request("r", prompt, SamplingParams(max_tokens=1))
        out = engine.scheduler.schedule()
        logits, _, _ = engine.runner.execute(out)
        engine.scheduler.update_from_output(out, {"r": 11})
        assert_engine_empty(engine)
        return logits[0].float()

    in_fp8 = prefill_logits()
    assert len(calls) == hf_config.num_hidden_layers
    monkeypatch.setattr(llama, "fp8_prefill_sequences", lambda *_: 0)
    in_float = prefill_logits()
    assert len(calls) == hf_config.num_hidden_layers
    assert not torch.equal(in_fp8, in_float)
    assert (in_fp8 - in_float).norm() < 0.05 * in_float.norm()
