"""Transformers-named weights into a Llama family model (`kvrail.worker.models.llama`): which
parameter, and which rows and columns of it on this rank, each checkpoint tensor fills.

The model fuses Q, K and V into one projection and gate/up into another; with tensor
parallelism it holds this rank's shard (`kvrail.worker.parallel.layout`). `LlamaWeights` cuts
that shard out of full transformers-named weights (tensors, or lazy safetensors slices so a rank
reads only its shard), quantizes a float weight row by row into an FP8 projection or copies an
FP8 one as stored (with `weight_scale`, and `input_scale` where static), and refuses a state
dict that leaves a parameter unset.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kvrail.errors import ConfigError
from kvrail.kernels.reference import FP8_WEIGHT_DTYPE, quantize_fp8_rows
from kvrail.worker.layers.linear import Projection
from kvrail.worker.models.llama_shape import LlamaShape
from kvrail.worker.parallel.layout import TpLayout


class LlamaWeights:
    """How the transformers weights of a model of `shape` map onto this rank's shard
    (`layout`)."""

    def __init__(self, shape: LlamaShape, layout: TpLayout) -> None:
        self.shape = shape
        self.layout = layout

    @torch.no_grad()
    def load(self, model: nn.Module, state_dict: Mapping[str, Any]) -> None:
        """Copy this rank's shard of transformers-named weights in; raise ConfigError on unknown,
        missing or wrongly sized ones. Values are tensors or lazy slices (anything with `shape`
        or `get_shape()` that slices like a tensor, as safetensors' `get_slice` returns). Into
        an FP8 projection, a float weight is quantized row by row and an FP8 one copied with
        its `weight_scale` (and `input_scale`) entries."""
        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
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
