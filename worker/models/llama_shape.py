"""The numbers a Llama family model (Llama 2/3, Qwen2/2.5, Mistral) is built from, read once
from a transformers config and checked there: the model (`kvrail.worker.models.llama`) and the
tensor-parallel checks before any rank starts (`kvrail.worker.ranks.build`) both take them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrail.errors import ConfigError
from kvrail.worker.layers.rotary import rope_settings

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The numbers the model is built from, read once from a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]

    @classmethod
    def from_config(cls, config: Any) -> LlamaShape:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ConfigError(f"{num_heads} attention heads are not a multiple of {num_kv_heads}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        max_position = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        if (
            window is not None
            and getattr(config, "use_sliding_window", True)
            and window < max_position
        ):
            # NOTE(engine): no sliding-window attention yet; serve only lengths it never limits.
            max_position = window
        attention_bias = bool(getattr(config, "attention_bias", False))
        theta, scaling = rope_settings(config)
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position=max_position,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_theta=theta,
            rope_scaling=tuple(sorted(scaling.items())),
        )
