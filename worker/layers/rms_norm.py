"""RMSNorm, computed in float32 and cast back (the order transformers uses, so outputs match).

Given a residual, the module first adds it (fused into one kernel on CUDA) and returns the sum
too, which is the residual stream the next block adds to.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from kvrail.kernels import dispatch


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
