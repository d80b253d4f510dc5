"""A linear layer that runs through `kvrail.kernels.dispatch.linear` (the skinny split-K kernel
for decode-sized batches on a GPU with programmatic dependent launch, torch otherwise).

A subclass of `nn.Linear`, so parameter names, initialisation and loading are torch's.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrail.kernels import dispatch


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(x, self.weight, self.bias)
