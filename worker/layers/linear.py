"""Linear layers that run through `kvrail.kernels.dispatch` (the skinny split-K kernel for
decode-sized batches on a GPU with programmatic dependent launch, torch otherwise).

Subclasses of `nn.Linear`, so parameter names, initialisation and loading are torch's. With
tensor parallelism (`kvrail.worker.parallel.layout`) a column-parallel projection is a plain
`Linear` over this rank's output rows; `RowParallelLinear` adds the all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrail.kernels import dispatch
from kvrail.worker.parallel.group import TpGroup


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(x, self.weight, self.bias)


class GatedLinear(nn.Linear):
    """A SwiGLU MLP's gate and up projections as one weight [2 * intermediate, hidden] (gate rows
    first); the output is the activation silu(gate) * up [.., intermediate], which decode batches
    get from one kernel (`kvrail.kernels.dispatch.gated_linear`)."""

    def __init__(self, in_features: int, intermediate: int, bias: bool = False) -> None:
        super().__init__(in_features, 2 * intermediate, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.gated_linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """The row-parallel half of a Megatron pair (attention's O, the MLP's down projection): this
    rank's weight columns [out, in / size] over its slice of the input, summed over the group
    by one all-reduce, then the bias (replicated, added once). With a group of one it is
    `Linear`."""

    def __init__(self, in_features: int, out_features: int, group: TpGroup, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return dispatch.linear(x, self.weight, self.bias)
        out = self.group.all_reduce(dispatch.linear(x, self.weight, None))
        return out if self.bias is None else out + self.bias
