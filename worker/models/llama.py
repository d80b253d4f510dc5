"""The Llama family decoder (Llama 2/3, Qwen2/2.5, Mistral) over a paged KV cache.

Built from a transformers config. Q, K and V are one fused projection and gate/up another;
`load_weights` maps transformers parameter names onto them and refuses a state dict that leaves a
parameter unset. Projections go through `Linear` (a skinny split-K kernel for decode-sized
batches on the GPU; `GatedLinear` applies SiLU * up in that kernel's epilogue). Elementwise work
goes through fused kernels (`kvrail.kernels.dispatch`): residual add + RMSNorm, rotary + KV
write, SiLU * up; on CPU their references run the same op sequence the unfused model did, so CPU
outputs are unchanged bit for bit. The forward pass takes packed tokens (no padding) with their
positions and the step's `AttentionMetadata`, and returns hidden states; `compute_logits` runs
the LM head only on the rows that are sampled.

Tensor parallelism: built with a `TpGroup` of several ranks, the model holds this rank's shard
(`kvrail.worker.parallel.layout`): its query and KV heads in QKV, its MLP columns in gate/up,
the matching input columns of O and down (row-parallel, one all-reduce each), its vocabulary rows
of the embedding and the LM head. `load_weights` (`llama_weights.py`) cuts the shard out of full
transformers-named weights (tensors, or lazy safetensors slices so a rank reads only its shard),
and `compute_logits` returns this rank's vocabulary shard (the model runner gathers them).

FP8 weights (`kvrail.worker.models.quant`): `build` makes every decoder projection FP8 before
`load_weights` fills it, from a float checkpoint by quantizing each row of this rank's shard,
from an FP8 one as stored (with `weight_scale`, and `input_scale` where static).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from kvrail.kernels import dispatch
from kvrail.kernels.reference import dequantize_rows
from kvrail.worker.kv_cache import KVCache
from kvrail.worker.layers.attention import (
    AttentionMetadata,
    fp8_prefill_sequences,
    paged_attention,
)
from kvrail.worker.layers.linear import GatedLinear, Linear, Projection, RowParallelLinear
from kvrail.worker.layers.rms_norm import RMSNorm
from kvrail.worker.layers.rotary import RotaryEmbedding
from kvrail.worker.layers.vocab_embedding import VocabParallelEmbedding
from kvrail.worker.models.llama_shape import LlamaShape
from kvrail.worker.models.llama_weights import LlamaWeights
from kvrail.worker.models.quant import Quantization
from kvrail.worker.parallel.group import TpGroup
from kvrail.worker.parallel.layout import TpLayout


class DecoderLayer(nn.Module):
    def __init__(
        self,
        shape: LlamaShape,
        layer_idx: int,
        rotary: RotaryEmbedding,
        layout: TpLayout,
        group: TpGroup,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = layout.num_local_heads, layout.num_local_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = self.num_heads * shape.head_dim
        self.kv_size = self.num_kv_heads * shape.head_dim
        self.scale = shape.head_dim**-0.5
        self.rotary = [rotary]  # shared, not a submodule of every layer
        h = shape.hidden_size
        self.input_layernorm = RMSNorm(h, shape.rms_norm_eps)
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=shape.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, h, group, bias=shape.o_bias)
        self.post_attention_layernorm = RMSNorm(h, shape.rms_norm_eps)
        inter = layout.local_intermediate_size
        self.gate_up_proj = GatedLinear(h, inter, bias=shape.mlp_bias)
        self.down_proj = RowParallelLinear(inter, h, group, bias=shape.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache,
        fp8_sequences: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it). The sum
        of the two is the layer's output; the next norm adds them (fused with the norm). With
        `fp8_sequences` (the step's `fp8_prefill_sequences`), attention runs in FP8."""
        num_tokens = x.shape[0]
        h, residual = self.input_layernorm.into(self.qkv_proj, x, residual)
        qkv = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache.layer(self.layer_idx)
        rotary = self.rotary[0]
        rotary_args = (positions, q, k, v, rotary.cos, rotary.sin, k_cache, v_cache,
                       metadata.slot_mapping)  # fmt: skip
        if fp8_sequences:  # fresh prompts over an FP8 cache: attention in FP8, output quantized
            q8, k8, v8, v_amax = dispatch.rotary_write_kv_fp8(*rotary_args)
            rows = dispatch.fp8_causal_attention(
                q8, k8, v8, v_amax, fp8_sequences, self.scale, x.dtype
            )
            attn_out = rows if self.o_proj.takes_quantized_rows(rows) else dequantize_rows(rows)
        else:
            q, k = dispatch.rotary_write_kv(*rotary_args)
            attn = paged_attention(q, k, v, k_cache, v_cache, metadata, self.scale)
            attn_out = attn.reshape(num_tokens, self.q_size)
        x = self.o_proj(attn_out)
        h, residual = self.post_attention_layernorm.into(self.gate_up_proj, x, residual)
        x = self.down_proj(self.gate_up_proj.into(self.down_proj, h))  # silu(gate) * up
        return x, residual


class LlamaForCausalLM(nn.Module):
    @classmethod
    def build(
        cls,
        config: Any,
        state_dict: Mapping[str, Any],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quantization: Quantization = "none",
        group: TpGroup | None = None,
    ) -> LlamaForCausalLM:
        """The model in `dtype` on `device` with this rank's shard of `state_dict` loaded, its
        projections in FP8 with `quantization` fp8 (in that order: a cast to `dtype` after
        would turn the FP8 weights back)."""
        model = cls(config, group).to(dtype=dtype)
        if quantization == "fp8":
            for module in model.projections():
                module.to_fp8_()
        model.load_weights(state_dict)
        return model.to(device=device).eval()

    def __init__(self, config: Any, group: TpGroup | None = None) -> None:
        super().__init__()
        self.shape = shape = LlamaShape.from_config(config)
        self.group = group = group or TpGroup.single()
        self.layout = layout = TpLayout(
            group.rank, group.size, shape.num_heads, shape.num_kv_heads,
            shape.intermediate_size, shape.vocab_size,
        )  # fmt: skip
        self.rotary = RotaryEmbedding(
            shape.head_dim, shape.max_position, shape.rope_theta, dict(shape.rope_scaling)
        )
        vocab_rows = layout.padded_vocab_per_rank
        self.embed_tokens = VocabParallelEmbedding(
            vocab_rows, shape.hidden_size, layout.vocab_start, group
        )
        self.layers = nn.ModuleList(
            DecoderLayer(shape, i, self.rotary, layout, group) for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = Linear(shape.hidden_size, vocab_rows, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden]; `after_layer(n)` is called once the first n layers
        ran (their KV is written then, or queued on the current stream on CUDA)."""
        x = self.embed_tokens(input_ids)
        residual = None
        fp8_sequences = fp8_prefill_sequences(metadata, x.shape[0], kv_cache.tensor)  # the step's
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, metadata, kv_cache, fp8_sequences)
            if after_layer is not None:
                after_layer(i + 1)
        assert residual is not None, "a model has at least one layer"
        normed: tuple[torch.Tensor, torch.Tensor] = self.norm(x, residual)
        return normed[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's vocabulary shard [n, padded_vocab_per_rank] (all of them, [n,
        vocab], without tensor parallelism)."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights for benchmarks and tests: normal(0, std), unit norms, zero biases.
        Drawn on the parameters' device, so a seed gives the same weights per device type."""
        device = next(self.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=generator, device=device) * std
                param.copy_(values.to(param.dtype))

    @property
    def quantization(self) -> Quantization:
        return "fp8" if any(m.is_fp8 for m in self.projections()) else "none"

    def projections(self) -> list[Projection]:
        """The decoder layers' projections (QKV, O, gate/up, down): what FP8 quantizes."""
        return [m for layer in self.layers for m in layer.modules() if isinstance(m, Projection)]

    def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Copy this rank's shard of transformers-named weights in (`LlamaWeights.load`); raise
        ConfigError on unknown, missing or wrongly sized ones."""
        LlamaWeights(self.shape, self.layout).load(self, state_dict)
