"""Linear layers that run through `kvrail.kernels.dispatch` (the skinny split-K kernel for
decode-sized batches on a GPU with programmatic dependent launch, torch otherwise).

Subclasses of `nn.Linear`, so parameter names, initialisation and loading are torch's. With
tensor parallelism (`kvrail.worker.parallel.layout`) a column-parallel projection is a plain
`Linear` over this rank's output rows; `RowParallelLinear` adds the all-reduce.

FP8 weights (`Projection.to_fp8_`): the weight is e4m3 with a float32 scale per output row
(`weight_scale`), and from a checkpoint quantized with static activation scales, one
`input_scale`; `LlamaForCausalLM.load_weights` fills them (see `kvrail.worker.models.quant`).
An FP8 projection can multiply its input's rows quantized per token (`takes_quantized_rows`),
and the module writing that input then quantizes it as it writes it (`into` of `RMSNorm`, and
of `GatedLinear` for prefill-sized batches: `kvrail.kernels.dispatch.quantize_gated_output`);
the projection takes the `QuantizedRows`.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrail.kernels import dispatch
from kvrail.kernels.reference import FP8_WEIGHT_DTYPE, QuantizedRows
from kvrail.worker.parallel.group import TpGroup


class Projection(nn.Linear):
    """What the three projections share: the weight, or its FP8 form and scales."""

    weight_scale: torch.Tensor | None
    input_scale: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("weight_scale", None)
        self.register_buffer("input_scale", None)

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8_WEIGHT_DTYPE

    @torch.no_grad()
    def to_fp8_(self) -> None:
        """Make the weight e4m3 storage (zeros) with unit scales, for `load_weights` to fill. A
        later `Module.to(dtype=...)` would cast it back: call this after the model's dtype is
        set, and move the model with `to(device)` only."""
        weight = self.weight
        self.weight = nn.Parameter(
            torch.zeros(weight.shape, dtype=FP8_WEIGHT_DTYPE, device=weight.device),
            requires_grad=False,
        )
        self.weight_scale = torch.ones(weight.shape[0], dtype=torch.float32, device=weight.device)

    def takes_quantized_rows(self, x: torch.Tensor | QuantizedRows) -> bool:
        """Whether this projection of x (or of anything with x's rows) multiplies them quantized
        per token, so that whatever writes them may write them quantized."""
        return dispatch.takes_quantized_rows(x, self.weight)

    def _project(self, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None) -> torch.Tensor:
        return dispatch.linear(x, self.weight, bias, self.weight_scale, self.input_scale)


class Linear(Projection):
    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return self._project(x, self.bias)


class GatedLinear(Projection):
    """A SwiGLU MLP's gate and up projections as one weight [2 * intermediate, hidden] (gate rows
    first); the output is the activation silu(gate) * up [.., intermediate], which decode batches
    get from one kernel (`kvrail.kernels.dispatch.gated_linear`)."""

    def __init__(self, in_features: int, intermediate: int, bias: bool = False) -> None:
        super().__init__(in_features, 2 * intermediate, bias=bias)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return dispatch.gated_linear(x, self.weight, self.bias, self.weight_scale, self.input_scale)

    def into(
        self, projection: Projection, x: torch.Tensor | QuantizedRows
    ) -> torch.Tensor | QuantizedRows:
        """silu(gate) * up for `projection`: as `forward`, quantized where `projection` takes
        quantized rows."""
        if not dispatch.quantize_gated_output(x, projection.weight):
            return self.forward(x)
        return dispatch.gated_linear_fp8(
            x, self.weight, self.bias, self.weight_scale, self.input_scale, projection.input_scale
        )


class RowParallelLinear(Projection):
    """The row-parallel half of a Megatron pair (attention's O, the MLP's down projection): this
    rank's weight columns [out, in / size] over its slice of the input, summed over the group
    by one all-reduce, then the bias (replicated, added once). With a group of one it is
    `Linear`."""

    def __init__(self, in_features: int, out_features: int, group: TpGroup, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if self.group.size == 1:
            return self._project(x, self.bias)
        out = self.group.all_reduce(self._project(x, None))
        return out if self.bias is None else out + self.bias
