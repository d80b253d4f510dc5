"""Test helpers shipped with the worker (the `kopf.testing` precedent): factories for requests,
schedulers, tiny model configs and engines, `assert_engine_empty`, the leak check every
scheduler and engine test ends with, and `GpuTimedCopier`, host-tier loads with a GPU's timing."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from kvrail.hashing import root_hash
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.block_pool import BlockPool
from kvrail.worker.engine.config import EngineConfig
from kvrail.worker.engine.kv_tiers.copier import Copier, CopyHandle
from kvrail.worker.engine.kv_tiers.tiers import KvTiers
from kvrail.worker.engine.request import Request
from kvrail.worker.engine.scheduler import Scheduler
from kvrail.worker.engine.stop import StopChecker
from kvrail.worker.kv_cache import KVCache

TEST_HASH_ROOT = root_hash("kvrail-test-fingerprint")
EOS_TOKEN_ID = 2
_ids = itertools.count()


def make_request(
    num_prompt_tokens: int = 8,
    *,
    prompt_token_ids: list[int] | None = None,
    request_id: str | None = None,
    **params: Any,
) -> Request:
    """A request with `prompt_token_ids` or `num_prompt_tokens` distinct ids (>= 10, so never EOS).
    `params` go to SamplingParams; max_tokens defaults to 16 and ignore_eos to True here."""
    if prompt_token_ids is None:
        start = 10 + 1000 * next(_ids)
        prompt_token_ids = list(range(start, start + num_prompt_tokens))
    params.setdefault("max_tokens", 16)
    params.setdefault("ignore_eos", True)
    return Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(**params),
    )


def make_engine_config(**overrides: Any) -> EngineConfig:
    """A small config: 4-token blocks, 64 blocks, 32-token budget, 1024-token model limit."""
    values: dict[str, Any] = {
        "num_blocks": 64,
        "block_size": 4,
        "max_num_batched_tokens": 32,
        "max_model_len": 1024,
    }
    values.update(overrides)
    return EngineConfig(**values)


def make_scheduler(**overrides: Any) -> Scheduler:
    return Scheduler(make_engine_config(**overrides), TEST_HASH_ROOT, StopChecker(EOS_TOKEN_ID))


def tiny_llama_config(**overrides: Any) -> Any:
    """A transformers config for a tiny random-weight Llama (GQA 4:2, 2 layers)."""
    from transformers import LlamaConfig

    values: dict[str, Any] = {
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
    }
    values.update(overrides)
    return LlamaConfig(**values)


def run_scheduler_to_completion(
    scheduler: Scheduler, next_token: int = 50, max_steps: int = 10_000
) -> list[Any]:
    """Drive a scheduler without a model: every sampled token is `next_token`. Returns the
    SchedulerOutputs; checks the invariants after every step."""
    outputs: list[Any] = []
    for _ in range(max_steps):
        if not scheduler.requests:
            return outputs
        out = scheduler.schedule()
        scheduler.check_invariants()
        assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        sampled = {s.request.request_id: next_token for s in out.decodes + out.prefills}
        scheduler.update_from_output(out, sampled)
        scheduler.check_invariants()
        outputs.append(out)
    raise AssertionError(f"scheduler did not finish within {max_steps} steps")


def assert_engine_empty(engine_or_scheduler: Any) -> None:
    """No requests left, every ref count zero, free + cached-unreferenced == total - null block."""
    scheduler: Scheduler = getattr(engine_or_scheduler, "scheduler", engine_or_scheduler)
    assert not scheduler.requests, f"requests left: {sorted(scheduler.requests)}"
    assert not scheduler.waiting and not scheduler.running
    assert not scheduler.retained, f"retained blocks left: {sorted(scheduler.retained)}"
    manager = scheduler.kv_cache_manager
    assert not manager.req_to_blocks, f"block tables left: {sorted(manager.req_to_blocks)}"
    pool = manager.block_pool
    pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in pool.blocks), "a block is still referenced"
    used, cached, free = pool.counts()
    assert used == 0 and cached + free == pool.num_blocks - 1, (used, cached, free)


class GpuTimedCopier(Copier):
    """The host tier's copier on a CPU device (its copies and checksums run at once) whose loads
    report done when a GPU's would, with the engine scheduling one step ahead: the step
    scheduled in epoch e is on the device from the schedule of e+1 to that of e+2. A load
    ordered after the mark of epoch m (`Copier.load`: of those kept, the current schedule's and
    the one before; with none kept, after all work queued so far, which is the same as the
    current one's) waits for the step of m-1, runs beside the step of m and, shorter than a
    step, is done at the schedule of m+2. `loads` records, per load: the epoch it started, the
    latest release of its blocks and the mark it waited for."""

    def __init__(self, kv_cache: KVCache, num_slots: int, pool: BlockPool) -> None:
        super().__init__(kv_cache, num_slots)
        self.pool = pool
        self.epoch = 0
        self.loads: list[tuple[int, int, int]] = []

    def mark(self, epoch: int) -> None:
        self.epoch = epoch

    def load(
        self,
        slots: Sequence[int],
        block_ids: Sequence[int],
        checksums: Sequence[int],
        after_mark: int | None = None,
    ) -> Any:
        handle = super().load(slots, block_ids, checksums)
        early = after_mark is not None and after_mark <= self.epoch - 1
        mark = self.epoch - 1 if early else self.epoch
        released = max(self.pool.blocks[i].released_at for i in block_ids)
        self.loads.append((self.epoch, released, mark))
        return _DoneAt(handle, self, mark + 2)


class _DoneAt:
    """A copy's handle that reports done from schedule epoch `epoch` on."""

    def __init__(self, handle: CopyHandle, copier: GpuTimedCopier, epoch: int) -> None:
        self._handle, self._copier, self._epoch = handle, copier, epoch

    def done(self) -> bool:
        return self._copier.epoch >= self._epoch

    def result(self) -> list[int]:
        assert self.done(), "read a copy's result once it is done"
        return self._handle.result()


def attach_gpu_timed_tiers(scheduler: Scheduler, host_blocks: int) -> GpuTimedCopier:
    """Give `scheduler` a host tier of `host_blocks` 64-byte blocks over a zero KV cache, whose
    loads have a GPU's timing (`GpuTimedCopier`)."""
    manager = scheduler.kv_cache_manager
    num_blocks = scheduler.config.num_blocks
    region = KVCache(torch.zeros(num_blocks, 16), num_blocks)
    tiers = KvTiers(region, host_blocks * 64, pin=manager.pin, unpin=manager.unpin,
                    layout=bytes(32))  # fmt: skip
    tiers.copier = copier = GpuTimedCopier(region, tiers.host.num_slots, manager.block_pool)
    scheduler.attach_tiers(tiers)
    return copier


def make_engine(
    hf_config: Any, state_dict: dict[str, Any] | None = None, seed: int = 0, **overrides: Any
) -> Any:
    """An engine over a model built from `hf_config`, with `state_dict` (transformers names) or
    random weights; `overrides` go to EngineConfig (defaults: make_engine_config's)."""
    from kvrail.worker.engine.engine import LLMEngine
    from kvrail.worker.engine.fingerprint import make_fingerprint
    from kvrail.worker.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(hf_config)
    if state_dict is None:
        model.init_random(seed)
    else:
        model.load_weights(state_dict)
    overrides.setdefault("max_model_len", min(1024, model.shape.max_position))
    config = make_engine_config(**overrides)
    fingerprint = make_fingerprint(model, config, f"test-weights-{seed}", "test-tokenizer")
    eos = getattr(hf_config, "eos_token_id", None)
    return LLMEngine(model, config, fingerprint, eos_token_id=eos)


def write_random_model(path: Any, seed: int = 0, dtype: Any = None, **overrides: Any) -> Any:
    """A model directory as a worker loads one (config.json, model.safetensors, tokenizer files):
    a random-weight Llama (transformers' own initialisation, seeded, in `dtype`: float32 unless
    given) with SmolLM2's tokenizer, so its vocabulary (`vocab_size`, default 49155: not a
    multiple of 2 or 4, so tensor-parallel vocabulary shards are padded) covers the tokenizer's.
    `overrides` go to the config (defaults: 4 layers, hidden 64, 8 heads, 4 KV heads). Returns
    `path`."""
    from pathlib import Path

    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvrail.model_files import resolve
    from kvrail.worker.models.loader import prepare

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(prepare(resolve("smollm2")))
    values: dict[str, Any] = {
        "vocab_size": 49155, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
    }  # fmt: skip
    values.update(overrides)
    config = LlamaConfig(**values)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def record_shared_prefixes(monkeypatch: Any) -> list[Any]:
    """A list that receives what `model_runner.find_shared_prefixes` returns at each step from
    now on (pytest's `monkeypatch` undoes the spy after the test)."""
    from kvrail.worker.engine.shared_prefix import find_shared_prefixes

    found: list[Any] = []

    def spy(*args: Any) -> Any:
        found.append(find_shared_prefixes(*args))
        return found[-1]

    monkeypatch.setattr("kvrail.worker.engine.model_runner.find_shared_prefixes", spy)
    return found
