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
of the embedding and the LM head. `load_weights` cuts the shard out of full transformers-named
weights (tensors, or lazy safetensors slices so a rank reads only its shard), and
`compute_logits` returns this rank's vocabulary shard (the model runner gathers them).

FP8 weights (`kvrail.worker.models.quant`): `build` makes every decoder projection FP8 before
`load_weights` fills it, from a float checkpoint by quantizing each row of this rank's shard,
from an FP8 one as stored (with `weight_scale`, and `input_scale` where static).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kvrail.errors import ConfigError
from kvrail.kernels import dispatch
from kvrail.kernels.reference import FP8_WEIGHT_DTYPE, dequantize_rows, quantize_fp8_rows
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
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        fp8_sequences = fp8_prefill_sequences(metadata, x.shape[0], kv_cache.tensor)  # the step's
        for layer in self.layers:
            x, residual = layer(x, residual, positions, metadata, kv_cache, fp8_sequences)
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

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Copy this rank's shard of transformers-named weights in; raise ConfigError on unknown,
        missing or wrongly sized ones. Values are tensors or lazy slices (anything with `shape`
        or `get_shape()` that slices like a tensor, as safetensors' `get_slice` returns). Into
        an FP8 projection, a float weight is quantized row by row and an FP8 one copied with
        its `weight_scale` (and `input_scale`) entries."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        filled: dict[str, int] = {}
        static: set[str] = set()  # the FP8 projections that got an input scale
        for hf_name, tensor in state_dict.items():
            if hf_name == "lm_head.weight" and self.shape.tie_word_embeddings:
                continue
            if hf_name.endswith((".weight_scale", ".input_scale")):
                self._load_scale(hf_name, tensor, modules, filled, static)
                continue
            shape = _shape_of(tensor)
            target, offset, rows, cols, split = self._map_name(hf_name, shape)
            if target not in params:
                raise ConfigError(f"weight {hf_name!r} has no parameter in this model")
            param = params[target]
            if split is not None and shape[split[0]] != split[1]:  # cut only whole weights
                raise ConfigError(f"weight {hf_name!r} has the wrong size for {target}")
            shard = tensor[rows] if cols is None else tensor[rows, cols]
            if offset + shard.shape[0] > param.shape[0] or shard.shape[1:] != param.shape[1:]:
                raise ConfigError(f"weight {hf_name!r} has the wrong size for {target}")
            end = offset + shard.shape[0]
            if (shard.dtype == FP8_WEIGHT_DTYPE) != (param.dtype == FP8_WEIGHT_DTYPE):
                if param.dtype != FP8_WEIGHT_DTYPE:
                    raise ConfigError(f"weight {hf_name!r} is FP8 but {target} is not")
                module = modules[target.removesuffix(".weight")]
                assert isinstance(module, Projection) and module.weight_scale is not None
                values, scales = quantize_fp8_rows(shard)
                param[offset:end].copy_(values)
                module.weight_scale[offset:end] = scales
                scale_name = f"{target.removesuffix('.weight')}.weight_scale"
                filled[scale_name] = filled.get(scale_name, 0) + shard.shape[0]
            else:
                param[offset:end].copy_(shard.to(param.dtype))
            filled[target] = filled.get(target, 0) + shard.shape[0]
            if target in ("embed_tokens.weight", "lm_head.weight"):
                param[shard.shape[0] :].zero_()  # the last rank's padding rows
                filled[target] = param.shape[0]
        expected = {n: p.shape[0] for n, p in params.items()}
        fp8 = [(n, m) for n, m in modules.items() if isinstance(m, Projection) and m.is_fp8]
        expected.update((f"{n}.weight_scale", m.out_features) for n, m in fp8)
        missing = [n for n, rows in expected.items() if filled.get(n, 0) != rows]
        if missing:
            raise ConfigError(f"weights missing or of the wrong size for {missing[:5]}")
        if static and len(static) != len(fp8):
            unscaled = sorted({n for n, _ in fp8} - static)
            raise ConfigError(f"input_scale missing for {unscaled[:5]} (static activations)")

    def _load_scale(
        self, hf_name: str, tensor: Any, modules: Mapping[str, nn.Module], filled: dict[str, int],
        static: set[str],
    ) -> None:  # fmt: skip
        """One FP8 checkpoint scale: a `weight_scale` (one value, or one per row of the
        transformers weight) into this rank's rows of the projection's per-row scales, or an
        `input_scale` (one value), the largest of a fused projection's parts."""
        name, leaf = hf_name.rsplit(".", 1)
        values = torch.as_tensor(tensor[...] if hasattr(tensor, "get_shape") else tensor)
        values = values.float().reshape(-1)
        weight_name = f"{name}.weight"
        target, _, _, _, split = self._map_name(weight_name, (1, 1))
        module_name = target.removesuffix(".weight")
        module = modules.get(module_name)
        if not isinstance(module, Projection) or module.weight_scale is None:
            raise ConfigError(f"{hf_name!r} scales no projection of this model that is FP8")
        if leaf == "input_scale":
            if values.numel() != 1:
                raise ConfigError(f"{hf_name!r} is not one FP8 projection's input scale")
            scale = values.reshape(())
            previous = module.input_scale
            module.input_scale = scale if previous is None else torch.maximum(previous, scale)
            static.add(module_name)
            return
        # Rows of the whole transformers weight: a column-parallel part's split size, else
        # (row-parallel: its columns are split, never its rows) the projection's own.
        full_rows = split[1] if split is not None and split[0] == 0 else module.out_features
        if values.numel() == 1:
            values = values.expand(full_rows)
        if values.numel() != full_rows:
            raise ConfigError(f"{hf_name!r} has {values.numel()} scales for {full_rows} rows")
        _, offset, rows, _, _ = self._map_name(weight_name, (full_rows, 1))
        shard = values[rows]
        module.weight_scale[offset : offset + shard.shape[0]] = shard
        scale_name = f"{module_name}.weight_scale"
        filled[scale_name] = filled.get(scale_name, 0) + shard.shape[0]

    def _map_name(
        self, hf_name: str, shape: tuple[int, ...]
    ) -> tuple[str, int, slice, slice | None, tuple[int, int] | None]:
        """(parameter, first row in it, rows of the full weight, columns or None, and for a
        split weight (dimension, its full size)) of this rank's shard of the transformers weight
        `hf_name` of `shape`."""
        name = hf_name.removeprefix("model.")
        everything = slice(0, shape[0])
        layout, head, full = self.layout, self.shape.head_dim, self.shape
        if name in ("embed_tokens.weight", "lm_head.weight"):
            rows = slice(layout.vocab_start, layout.vocab_end)
            return name, 0, rows, None, (0, full.vocab_size)
        parts = name.split(".")
        if len(parts) != 5 or parts[0] != "layers":
            return name, 0, everything, None, None
        prefix, module, leaf = ".".join(parts[:2]), parts[3], parts[4]
        q_local = layout.num_local_heads * head
        kv_local = layout.num_local_kv_heads * head
        inter = layout.local_intermediate_size
        heads = slice(layout.head_start * head, layout.head_start * head + q_local)
        kv_heads = slice(layout.kv_head_start * head, layout.kv_head_start * head + kv_local)
        columns = slice(layout.intermediate_start, layout.intermediate_start + inter)
        q_size, kv_size = full.num_heads * head, full.num_kv_heads * head
        column_parallel = {
            "q_proj": ("qkv_proj", 0, heads, q_size),
            "k_proj": ("qkv_proj", q_local, kv_heads, kv_size),
            "v_proj": ("qkv_proj", q_local + kv_local, kv_heads, kv_size),
            "gate_proj": ("gate_up_proj", 0, columns, full.intermediate_size),
            "up_proj": ("gate_up_proj", inter, columns, full.intermediate_size),
        }
        row_parallel = {"o_proj": (heads, q_size), "down_proj": (columns, full.intermediate_size)}
        if module in column_parallel:
            target, offset, rows, size = column_parallel[module]
            return f"{prefix}.{target}.{leaf}", offset, rows, None, (0, size)
        if module in row_parallel and leaf == "weight":
            cols, size = row_parallel[module]
            return f"{prefix}.{module}.{leaf}", 0, everything, cols, (1, size)
        return f"{prefix}.{module}.{leaf}", 0, everything, None, None  # replicated


def _shape_of(tensor: Any) -> tuple[int, ...]:
    get_shape = getattr(tensor, "get_shape", None)
    return tuple(get_shape() if get_shape is not None else tensor.shape)
