"""RMSNorm, computed in float32 and cast back (the order transformers uses, so outputs match).

Given a residual, the module first adds it (fused into one kernel on CUDA) and returns the sum
too, which is the residual stream the next block adds to. Given `into`, the projection that takes
the output, and where that projection multiplies quantized rows
(`kvrail.worker.layers.linear.Projection.takes_quantized_rows`), the output comes quantized.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import torch
from torch import nn

from kvrail.kernels import dispatch
from kvrail.kernels.reference import QuantizedRows

if TYPE_CHECKING:
    from kvrail.worker.layers.linear import Projection


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(residual + x), residual + x); `residual` is consumed (a CUDA
        kernel overwrites it with the sum)."""
        if residual is None:
            return dispatch.rms_norm(x, self.weight, self.eps)
        return dispatch.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def into(
        self, projection: Projection, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """(norm(x) for `projection`, the residual stream): as `forward`, the output quantized
        where `projection` takes quantized rows; without a residual, x is the stream."""
        if projection.takes_quantized_rows(x):
            rows, summed = dispatch.rms_norm_fp8(
                x, residual, self.weight, self.eps, projection.input_scale
            )
            return rows, x if summed is None else summed
        if residual is None:
            return self.forward(x), x
        return self.forward(x, residual)
