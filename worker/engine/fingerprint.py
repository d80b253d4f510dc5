"""The fingerprint of an engine's model and KV layout: what a worker announces, so that only
workers whose KV is interchangeable pair (`kvrail.fingerprint`)."""

from __future__ import annotations

from kvrail.fingerprint import ModelFingerprint
from kvrail.worker.engine.config import EngineConfig, dtype_name, kv_cache_dtype
from kvrail.worker.models.llama import LlamaForCausalLM


def make_fingerprint(
    model: LlamaForCausalLM, config: EngineConfig, weights_id: str, tokenizer_id: str
) -> ModelFingerprint:
    shape = model.shape
    param = next(model.parameters())
    return ModelFingerprint(
        tensor_parallel_size=model.group.size,
        weights_id=weights_id,
        tokenizer_id=tokenizer_id,
        dtype=dtype_name(param.dtype),
        kv_dtype=dtype_name(kv_cache_dtype(config.kv_dtype, param.dtype, param.device.type)),
        quantization=model.quantization,
        block_size=config.block_size,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rope_theta=shape.rope_theta,
        rope_scaling=tuple((k, str(v)) for k, v in shape.rope_scaling),
    )
