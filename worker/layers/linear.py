"""Linear layers that run through `kvrail.kernels.dispatch` (the skinny split-K kernel for
decode-sized batches on a GPU with programmatic dependent launch, torch otherwise).

Subclasses of `nn.Linear`, so parameter names, initialisation and loading are torch's.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrail.kernels import dispatch


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
